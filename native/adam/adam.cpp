// Dispatch for the Adam kernels: ISA choice (once, at load time), per-step coefficients,
// and splitting a step across the native thread pool.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <stdexcept>
#include <string>

#include <fcntl.h>
#include <unistd.h>

#include "adam/adam.h"
#include "adam/adam_kernels.h"
#include "common/thread_pool.h"

namespace offload::adam {
namespace {

// Threads get ranges of a multiple of this many elements (a multiple of every vector width,
// so a range starts as aligned as the buffer does); 64 Ki elements move ~1.8 MB, large enough
// that the pool's hand-off is noise.
constexpr std::size_t kGrainNumel = std::size_t{1} << 16;

// Bytes a step moves per element with a 16-bit copy-out: see [Note: Adam memory traffic].
constexpr std::size_t kStepBytesPerElement = 30;

// A whole small sysfs file as a number and its unit suffix ("32768K"); false if unreadable.
// Plain POSIX reads: nothing here may depend on the C++ runtime's locale or streams.
bool read_sysfs_size(const std::string& path, long* value, char* unit) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char text[64] = {0};
  const ssize_t got = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  if (got <= 0) return false;
  char* end = nullptr;
  const long number = std::strtol(text, &end, 10);
  if (end == text) return false;
  *value = number;
  if (unit != nullptr) *unit = *end;
  return true;
}

// The size of the highest-level cache cpu0 has, as the kernel reports it in sysfs; 0 if
// unknown. Never glibc's sysconf(_SC_LEVEL*_CACHE_SIZE): glibc 2.36 takes an AMD CPU's L3
// from the legacy CPUID leaf 0x80000006, which on a 2-core AMD EPYC KVM guest says 320 MiB
// (sysfs: 32 MiB). Read with plain POSIX calls: on the lent H200 machine (Intel Xeon guest,
// the extension built there by the image's g++ in /opt/gcc) the first call of this, then
// reading sysfs through std::ifstream, crashed the process with SIGSEGV; a C program
// calling sysconf there did not. Without sysfs the threshold assumes a typical L3 share.
long sysfs_llc_bytes() {
  long best_level = 0, best_bytes = 0;
  for (int index = 0; index < 16; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    long level = 0, size = 0;
    char unit = 0;
    if (!read_sysfs_size(dir + "/level", &level, nullptr) || !read_sysfs_size(dir + "/size", &size, &unit)) break;
    if (unit == 'K') size <<= 10;
    if (unit == 'M') size <<= 20;
    if (level > best_level) best_level = level, best_bytes = size;
  }
  return best_bytes;
}

std::size_t default_stream_copy_out_min_numel() {
  long llc_bytes = sysfs_llc_bytes();
  if (llc_bytes <= 0) llc_bytes = long{32} << 20;  // unknown: a typical server L3 share
  return static_cast<std::size_t>(llc_bytes) / 2 / kStepBytesPerElement;
}

std::atomic<std::size_t>& stream_copy_out_min() {
  static std::atomic<std::size_t> numel{default_stream_copy_out_min_numel()};
  return numel;
}

bool cpu_has(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  }
  return false;
}

// The load-time choice. An invalid OFFLOAD_FORCE_ISA is remembered, not thrown here (a
// static initializer must not throw); every use reports it.
struct Selection {
  std::atomic<int> isa{static_cast<int>(Isa::kScalar)};
  std::string error;

  Selection() {
    Isa best = Isa::kScalar;
    for (Isa candidate : available_isas()) best = candidate;
    isa = static_cast<int>(best);
    const char* forced = std::getenv("OFFLOAD_FORCE_ISA");
    if (forced == nullptr || *forced == '\0') return;
    try {
      const Isa wanted = parse_isa(forced);
      if (cpu_has(wanted)) {
        isa = static_cast<int>(wanted);
      } else {
        error = std::string("OFFLOAD_FORCE_ISA=") + forced + ": this CPU cannot run the '" +
                forced + "' Adam kernel";
      }
    } catch (const std::invalid_argument& e) {
      error = std::string("OFFLOAD_FORCE_ISA: ") + e.what();
    }
  }
};

Selection& selection() {
  static Selection s;
  return s;
}

// Make the choice when the library loads, not at the first step.
[[maybe_unused]] const bool kSelectedAtLoad = (selection(), true);

detail::Coefficients coefficients(const Hyperparameters& h) {
  // Double arithmetic mirrors torch's Python-float arithmetic in _single_tensor_adam,
  // including `bias_correction2 ** 0.5` (pow, not sqrt); each result is then rounded to
  // float as ATen does with a Python scalar operand.
  const double bias_correction1 = 1.0 - std::pow(h.beta1, h.step);
  const double bias_correction2 = 1.0 - std::pow(h.beta2, h.step);
  const double step_size = h.lr / bias_correction1;
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  const bool decay = h.weight_decay != 0.0;

  detail::Coefficients k;
  k.grad_scale = static_cast<float>(h.grad_scale);
  k.l2 = decay && !h.adamw;
  k.l2_decay = static_cast<float>(h.weight_decay);
  k.param_decay = decay && h.adamw ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  k.lerp_weight = static_cast<float>(1.0 - h.beta1);
  k.lerp_small = std::fabs(k.lerp_weight) < 0.5f;
  k.lerp_weight_minus_one = k.lerp_weight - 1.0f;
  k.beta2 = static_cast<float>(h.beta2);
  k.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  k.bias_correction2_sqrt = static_cast<float>(bias_correction2_sqrt);
  k.eps = static_cast<float>(h.eps);
  k.neg_step_size = static_cast<float>(-step_size);
  return k;
}

using Kernel = void (*)(const Buffers&, const detail::Coefficients&, const detail::Streaming&);

Kernel kernel_for(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return &detail::step_scalar;
    case Isa::kAvx2: return &detail::step_avx2;
    case Isa::kAvx512: return &detail::step_avx512;
  }
  throw std::logic_error("unknown Isa");
}

std::size_t element_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

void check(const Buffers& b) {
  auto valid = [](DType d) {
    return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16;
  };
  if (!valid(b.grad_dtype)) throw std::invalid_argument("adam: unknown grad dtype code");
  if (b.copy_out != nullptr && b.copy_out_dtype != DType::kBFloat16 &&
      b.copy_out_dtype != DType::kFloat16) {
    throw std::invalid_argument("adam: copy_out must be bfloat16 or float16");
  }
  if (b.numel > 0 && (b.param == nullptr || b.grad == nullptr || b.exp_avg == nullptr ||
                      b.exp_avg_sq == nullptr)) {
    throw std::invalid_argument("adam: null buffer pointer");
  }
  // [Note: out-of-place Adam] an output set apart from its input overlaps nothing.
  struct Span {
    const char* name;
    const void* begin;
    std::size_t bytes;
  };
  const std::size_t n = b.numel;
  const Span spans[] = {
      {"param", b.param, n * 4},          {"grad", b.grad, n * element_bytes(b.grad_dtype)},
      {"exp_avg", b.exp_avg, n * 4},      {"exp_avg_sq", b.exp_avg_sq, n * 4},
      {"copy_out", b.copy_out, b.copy_out != nullptr ? n * 2 : 0},
      {"param_out", b.param_out, b.param_out != b.param ? n * 4 : 0},
      {"exp_avg_out", b.exp_avg_out, b.exp_avg_out != b.exp_avg ? n * 4 : 0},
      {"exp_avg_sq_out", b.exp_avg_sq_out, b.exp_avg_sq_out != b.exp_avg_sq ? n * 4 : 0},
  };
  auto overlap = [](const Span& x, const Span& y) {
    const auto a = reinterpret_cast<std::uintptr_t>(x.begin);
    const auto c = reinterpret_cast<std::uintptr_t>(y.begin);
    return x.bytes > 0 && y.bytes > 0 && a < c + y.bytes && c < a + x.bytes;
  };
  for (std::size_t i = 5; i < std::size(spans); ++i) {
    for (std::size_t j = 0; j < std::size(spans); ++j) {
      if (j != i && overlap(spans[i], spans[j])) {
        throw std::invalid_argument(std::string("adam: ") + spans[i].name + " overlaps " +
                                    spans[j].name);
      }
    }
  }
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

Isa parse_isa(const std::string& name) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (name == isa_name(isa)) return isa;
  }
  throw std::invalid_argument("unknown Adam ISA '" + name +
                              "'; expected one of: scalar, avx2, avx512");
}

std::vector<Isa> available_isas() {
  std::vector<Isa> isas;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (cpu_has(isa)) isas.push_back(isa);
  }
  return isas;
}

Isa selected_isa() {
  Selection& s = selection();
  if (!s.error.empty()) throw std::runtime_error(s.error);
  return static_cast<Isa>(s.isa.load());
}

void set_isa(Isa isa) {
  if (!cpu_has(isa)) {
    throw std::runtime_error(std::string("this CPU cannot run the '") + isa_name(isa) +
                             "' Adam kernel");
  }
  Selection& s = selection();
  s.isa = static_cast<int>(isa);
  s.error.clear();
}

std::size_t stream_copy_out_min_numel() { return stream_copy_out_min().load(); }

void set_stream_copy_out_min_numel(std::size_t numel) { stream_copy_out_min() = numel; }

void step(const Buffers& given, const Hyperparameters& hyper) {
  Buffers buffers = given;  // [Note: out-of-place Adam] an output left null is its input
  if (buffers.param_out == nullptr) buffers.param_out = const_cast<float*>(buffers.param);
  if (buffers.exp_avg_out == nullptr) buffers.exp_avg_out = const_cast<float*>(buffers.exp_avg);
  if (buffers.exp_avg_sq_out == nullptr) {
    buffers.exp_avg_sq_out = const_cast<float*>(buffers.exp_avg_sq);
  }
  check(buffers);
  const Kernel kernel = kernel_for(selected_isa());
  const detail::Coefficients k = coefficients(hyper);
  const std::size_t n = buffers.numel;
  // Decided once for the whole step, not per thread range: it is the step's working set
  // that outgrows the cache. A copy_out that is not 2-byte aligned can never reach the
  // alignment streaming stores need (torch never hands us one).
  detail::Streaming streaming;
  streaming.copy_out = buffers.copy_out != nullptr && n >= stream_copy_out_min_numel() &&
                       reinterpret_cast<std::uintptr_t>(buffers.copy_out) % 2 == 0;
  // [Note: out-of-place Adam] outputs apart from their inputs are lines only written, as the
  // copy-out's are: the same threshold decides.
  streaming.state = n >= stream_copy_out_min_numel() &&
                    (buffers.param_out != buffers.param || buffers.exp_avg_out != buffers.exp_avg ||
                     buffers.exp_avg_sq_out != buffers.exp_avg_sq);
  const std::size_t grad_bytes = element_bytes(buffers.grad_dtype);
  offload::parallel_ranges(n, kGrainNumel, [&](std::size_t begin, std::size_t end) {
    Buffers part = buffers;
    part.numel = end - begin;
    part.param += begin;
    part.grad = static_cast<const char*>(buffers.grad) + begin * grad_bytes;
    part.exp_avg += begin;
    part.exp_avg_sq += begin;
    part.param_out += begin;
    part.exp_avg_out += begin;
    part.exp_avg_sq_out += begin;
    if (buffers.copy_out != nullptr) {
      part.copy_out = static_cast<char*>(buffers.copy_out) + begin * 2;
    }
    kernel(part, k, streaming);
  });
}

}  // namespace offload::adam
