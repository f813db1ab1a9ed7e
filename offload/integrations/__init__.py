"""Integrations of offload with other libraries, each in its own module and imported only
by name (``from offload.integrations.transformers import OffloadTrainer``): ``import
offload`` never imports them, nor the libraries they need."""
