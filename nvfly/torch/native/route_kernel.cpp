// nvfly's routed aten kernels in C++ (nvfly/torch/native_routes.py builds and loads this file).
//
// A route's kernel on its dispatch key. Python decides every call it has not seen (nvfly's kernel in
// nvfly/torch/routing.py: the switch, the route's skip, its signature's decision, nvfly's run or torch's kernel);
// a call that Python sent to torch's kernel (``mark_declined``) leaves its *call key* here, and later calls with that
// key go to torch's kernel at once, without entering Python: the dispatcher's hop into the interpreter is what a
// declined call cost (several µs a call, more inside a model step). Only declines are kept: a call whose key is new,
// or whose decision was to run nvfly, reaches Python (where routing is switched on in its thread / async context), so
// the worst a key that misses a change can do is send a call to torch's kernel, which is always correct.
//
// The call key: a generation (``forget`` starts a new one: Python's decisions were forgotten), grad and inference
// mode, the SDPA backends torch may use, and each argument: a tensor's dispatch keys, dtype, device, current stream
// (CUDA graphs capture on a stream of their own), sizes, strides, address modulo 16 and requires_grad; a scalar's
// value.
// Arguments of another kind (strings, tensor lists) make a call that is never kept.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <cstring>
#include <memory>
#include <unordered_set>
#include <vector>

namespace {

namespace py = pybind11;
using CallKey = std::vector<int64_t>;

struct CallKeyHash {
  size_t operator()(const CallKey& key) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : key) {
      h ^= static_cast<uint64_t>(v);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

constexpr size_t MAX_KEYS = 4096;  // declined call keys a route keeps before it starts again
std::atomic<int64_t> generation{0};
thread_local bool declined_here = false;  // set by Python (mark_declined) while it handles a call

enum Tag : int64_t { NONE = 1, TENSOR, UNDEFINED, INT, DOUBLE, BOOL, INTS };

// The argument's part of the call key; false: an argument no key describes
bool describe(const c10::IValue& value, CallKey& key) {
  if (value.isNone()) {
    key.push_back(NONE);
  } else if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    if (!t.defined()) {
      key.push_back(UNDEFINED);
      return true;
    }
    key.push_back(TENSOR);
    key.push_back(static_cast<int64_t>(t.key_set().raw_repr()));
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(static_cast<int64_t>(t.device().type()) << 16 | (t.device().index() + 1));
    if (t.is_cuda()) {
      key.push_back(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device()).id());
    }
    key.push_back(t.dim() << 1 | static_cast<int64_t>(t.requires_grad()));
    if (t.is_sparse() || t.layout() != at::kStrided) {
      return false;
    }
    for (int64_t i = 0; i < t.dim(); ++i) {
      key.push_back(t.sizes()[i]);
      key.push_back(t.strides()[i]);
    }
    key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15));
  } else if (value.isBool()) {
    key.push_back(BOOL);
    key.push_back(value.toBool());
  } else if (value.isInt()) {
    key.push_back(INT);
    key.push_back(value.toInt());
  } else if (value.isDouble()) {
    key.push_back(DOUBLE);
    double d = value.toDouble();
    int64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    key.push_back(bits);
  } else if (value.isIntList()) {
    auto ints = value.toIntList();
    key.push_back(INTS);
    key.push_back(static_cast<int64_t>(ints.size()));
    for (int64_t v : ints) {
      key.push_back(v);
    }
  } else {
    return false;
  }
  return true;
}

struct RouteKernel final : c10::OperatorKernel {
  // routing_switch: routing's context variable, borrowed (a module global of nvfly.torch.routing, alive as long as
  // the interpreter). A kept key sends its call to torch's kernel whether routing is switched on or not (where it is
  // off, Python would send it there too); other calls read the switch first, and go to torch's kernel where it is off
  RouteKernel(c10::SafeKernelFunction torch_kernel, c10::SafeKernelFunction python_kernel, PyObject* routing_switch)
      : torch_kernel_(std::move(torch_kernel)), python_kernel_(std::move(python_kernel)), switch_(routing_switch) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    CallKey key;
    bool python_dispatch = c10::impl::TorchDispatchModeTLS::stack_len() > 0;
    bool keep = call_key(op, *stack, key, python_dispatch);
    bool to_torch;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      // a dispatch mode or a Python tensor subclass makes torch's Python kernel holder look for a kernel of this op
      // registered from Python: there is none (nvfly's is another op's), and nvfly declines such calls anyway
      to_torch = python_dispatch || (keep && declined_.count(key) > 0);
    }
    if (!to_torch) {
      py::gil_scoped_acquire gil;
      to_torch = !switched_on();
    }
    if (to_torch) {
      hits_.fetch_add(1, std::memory_order_relaxed);
      torch_kernel_.callBoxed(op, keys, stack);
      return;
    }
    bool outer = declined_here;  // a routed call inside nvfly's own (its fallthrough) keeps the outer call's mark
    declined_here = false;
    python_kernel_.callBoxed(op, keys, stack);
    bool declined = declined_here;
    declined_here = outer;
    if (keep && declined) {
      std::lock_guard<std::mutex> guard(mutex_);
      if (declined_.size() >= MAX_KEYS) {
        declined_.clear();
      }
      declined_.insert(std::move(key));
    }
  }

  int64_t hits() const { return hits_.load(std::memory_order_relaxed); }

 private:
  // Routing's switch in this thread / async context (under the interpreter's lock)
  bool switched_on() const {
    PyObject* value = nullptr;
    if (PyContextVar_Get(switch_, Py_False, &value) < 0) {
      PyErr_Clear();
      return true;  // Python decides, and reads the switch itself
    }
    bool on = PyObject_IsTrue(value) == 1;
    Py_DECREF(value);
    return on;
  }

  // The call's key; false: an argument no key describes (the call is never kept)
  // ``python_dispatch`` is set when a tensor argument has the Python dispatch key
  static bool call_key(const c10::OperatorHandle& op, const torch::jit::Stack& stack, CallKey& key,
                       bool& python_dispatch) {
    size_t arguments = op.schema().arguments().size();
    key.reserve(16 + 12 * arguments);
    key.push_back(generation.load(std::memory_order_relaxed));
    auto& context = at::globalContext();
    key.push_back(static_cast<int64_t>(c10::GradMode::is_enabled()) |
                  static_cast<int64_t>(c10::InferenceMode::is_enabled()) << 1 |
                  static_cast<int64_t>(context.userEnabledFlashSDP()) << 2 |
                  static_cast<int64_t>(context.userEnabledMemEfficientSDP()) << 3 |
                  static_cast<int64_t>(context.userEnabledCuDNNSDP()) << 4 |
                  static_cast<int64_t>(context.userEnabledMathSDP()) << 5);
    bool described = true;
    for (const c10::IValue& value : torch::jit::last(stack, arguments)) {
      if (value.isTensor() && value.toTensor().defined() &&
          value.toTensor().key_set().has(c10::DispatchKey::Python)) {
        python_dispatch = true;
      }
      described = described && describe(value, key);
    }
    return described;
  }

  c10::SafeKernelFunction torch_kernel_;
  c10::SafeKernelFunction python_kernel_;
  PyObject* switch_;
  std::mutex mutex_;  // the kept keys (calls come from any thread)
  std::atomic<int64_t> hits_{0};
  std::unordered_set<CallKey, CallKeyHash> declined_;
};

// The registrations in force and their kernels (never destroyed at exit: the dispatcher may be gone by then)
auto* libraries = new std::vector<std::unique_ptr<torch::Library>>();
auto* kernels = new std::vector<RouteKernel*>();

// Register the route kernel of aten op ``name`` ("mm.out") on dispatch key ``key``: torch's kernel there and nvfly's
// Python kernel (``torch.library.get_kernel`` results), routing's context variable
void register_route(const std::string& name, const std::string& key, py::object torch_kernel,
                    py::object python_kernel, py::object routing_switch) {
  if (!PyContextVar_CheckExact(routing_switch.ptr())) {
    throw std::invalid_argument("routing_switch: expected a contextvars.ContextVar");
  }
  auto dispatch_key = c10::parseDispatchKey(key);
  auto kernel = std::make_unique<RouteKernel>(torch_kernel.cast<c10::SafeKernelFunction>(),
                                              python_kernel.cast<c10::SafeKernelFunction>(), routing_switch.ptr());
  RouteKernel* raw = kernel.get();
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", dispatch_key, __FILE__, __LINE__);
  library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(kernel)));
  libraries->push_back(std::move(library));
  kernels->push_back(raw);
}

// Remove every registration (torch's kernels are dispatched again)
void reset() {
  kernels->clear();
  libraries->clear();
}

// Python sent the call it is handling to torch's kernel: its key is kept
void mark_declined() { declined_here = true; }

// Python forgot its decisions: the keys kept so far are not used again
void forget() { generation.fetch_add(1, std::memory_order_relaxed); }

// Calls sent to torch's kernel here without entering Python (a kept key, or routing switched off), over the
// registrations
int64_t hits() {
  int64_t total = 0;
  for (const RouteKernel* kernel : *kernels) {
    total += kernel->hits();
  }
  return total;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_route", &register_route);
  m.def("reset", &reset);
  m.def("mark_declined", &mark_declined);
  m.def("forget", &forget);
  m.def("hits", &hits);
}
