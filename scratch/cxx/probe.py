import time, torch
from torch.utils.cpp_extension import load_inline
src = r'''
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <memory>
#include <vector>

struct Fallthrough final : public c10::OperatorKernel {
  c10::SafeKernelFunction torch_kernel;
  explicit Fallthrough(c10::SafeKernelFunction k) : torch_kernel(std::move(k)) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    torch_kernel.callBoxed(op, ks, stack);
  }
};

static std::vector<std::unique_ptr<torch::Library>> libs;

void hop(const std::string& op, const std::string& key) {
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(op.c_str(), "");
  auto k = c10::parseDispatchKey(key);
  auto kernel = handle.getComputedKernelForDispatchKey(k);
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", k, __FILE__, __LINE__);
  lib->impl(op.substr(6).c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Fallthrough>(kernel)));
  libs.push_back(std::move(lib));
}
void reset() { libs.clear(); }
'''
m = load_inline("nvfly_hop_probe", cpp_sources=src, functions=["hop", "reset"], verbose=False)
print("built")
import sys; sys.argv = ["x", "8"]
import importlib.util
spec = importlib.util.spec_from_file_location("hc", "scratch/hopcost.py")
