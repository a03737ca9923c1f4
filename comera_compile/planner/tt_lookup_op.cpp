// The C lookup of tt_lookup.c as a torch operator whose autograd runs in C++
// (planner.native_lookup): a step's lookup then runs no Python in backward, and only the
// operator call in forward. A recommender's table is looked up a few thousand ids at a
// time, so the Python around the C loops cost as much as the loops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <vector>

extern "C" {
int64_t comera_tt_forward_f32(int, int64_t, const int64_t*, int64_t, int, const int64_t*,
                              const float*, int64_t, float*, int64_t*, int, const int64_t*,
                              const int64_t*, const int64_t*, const float* const*,
                              const float* const*, double, int64_t, int);
int64_t comera_tt_forward_f64(int, int64_t, const int64_t*, int64_t, int, const int64_t*,
                              const double*, int64_t, double*, int64_t*, int, const int64_t*,
                              const int64_t*, const int64_t*, const double* const*,
                              const double* const*, double, int64_t, int);
int comera_tt_grads_f32(int, int64_t, const float*, int64_t, const int64_t*, float*, int64_t,
                        const int64_t*, const int64_t*, int64_t, int, const int64_t*,
                        const int64_t*, const int64_t*, const float* const*,
                        const float* const*, double, float* const*, float* const*, float*,
                        int64_t, int);
int comera_tt_grads_f64(int, int64_t, const double*, int64_t, const int64_t*, double*, int64_t,
                        const int64_t*, const int64_t*, int64_t, int, const int64_t*,
                        const int64_t*, const int64_t*, const double* const*,
                        const double* const*, double, double* const*, double* const*, double*,
                        int64_t, int);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

template <typename T>
struct Kernels;
template <>
struct Kernels<float> {
  static constexpr auto forward = comera_tt_forward_f32;
  static constexpr auto grads = comera_tt_grads_f32;
};
template <>
struct Kernels<double> {
  static constexpr auto forward = comera_tt_forward_f64;
  static constexpr auto grads = comera_tt_grads_f64;
};

// The kernels' m, n and r arrays for slices-first cores (m, r, n, r').
struct Shape {
  std::vector<int64_t> m, n, r;
  explicit Shape(const std::vector<at::Tensor>& cores) {
    r.push_back(cores[0].size(1));
    for (const auto& c : cores) {
      m.push_back(c.size(0));
      n.push_back(c.size(2));
      r.push_back(c.size(3));
    }
  }
};

template <typename T>
std::vector<const T*> pointers(const std::vector<at::Tensor>& tensors) {
  std::vector<const T*> out;
  for (const auto& t : tensors) out.push_back(t.data_ptr<T>());
  return out;
}

template <typename T>
T* maybe(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

std::vector<at::Tensor> contiguous(at::TensorList tensors) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.contiguous());
  return out;
}

// Inputs, in order: ids, index, cache_weight, cores..., gates..., then 8 settings.
constexpr size_t kSettings = 8;

struct TTLookup : public torch::autograd::Function<TTLookup> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& ids_in,
                            const at::Tensor& index, const at::Tensor& weight_in,
                            at::TensorList cores_in, at::TensorList gates_in,
                            std::vector<bool> sparse, bool cache_sparse, int64_t width,
                            int64_t limit, double threshold, int64_t bits, int64_t bag,
                            bool mean) {
    auto ids = ids_in.to(at::kLong).contiguous();
    auto cores = contiguous(cores_in), gates = contiguous(gates_in);
    auto weight = weight_in.numel() ? weight_in.contiguous() : at::Tensor();
    const int64_t count = ids.numel(), order = static_cast<int64_t>(cores.size());
    Shape shape(cores);
    auto work = at::empty({3 + order, count}, ids.options());
    TORCH_CHECK(bag >= 1 && count % bag == 0, "ids (", count, ") are not bags of ", bag);
    auto out = at::empty({count / bag, width}, cores[0].options());
    int64_t hits = 0;
    AT_DISPATCH_FLOATING_TYPES(cores[0].scalar_type(), "comera_tt_lookup", [&] {
      auto core_ptrs = pointers<scalar_t>(cores);
      auto gate_ptrs = pointers<scalar_t>(gates);
      hits = Kernels<scalar_t>::forward(
          at::get_num_threads(), count, ids.data_ptr<int64_t>(), limit,
          static_cast<int>(bits), index.numel() ? index.data_ptr<int64_t>() : nullptr,
          maybe<scalar_t>(weight), width, out.data_ptr<scalar_t>(), work.data_ptr<int64_t>(),
          static_cast<int>(order), shape.m.data(), shape.n.data(), shape.r.data(),
          core_ptrs.data(), gates.empty() ? nullptr : gate_ptrs.data(), threshold, bag,
          mean ? 1 : 0);
    });
    if (hits == -1) {
      auto [low, high] = at::aminmax(ids);
      TORCH_CHECK_INDEX(false, "ids must lie in [0, ", limit, "), got [", low.item<int64_t>(),
                        ", ", high.item<int64_t>(), "]");
    }
    TORCH_CHECK(hits >= 0, "the C lookup could not allocate its scratch rows");
    std::vector<at::Tensor> saved{work};
    saved.insert(saved.end(), cores.begin(), cores.end());
    saved.insert(saved.end(), gates.begin(), gates.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["order"] = order;
    ctx->saved_data["hits"] = hits;
    ctx->saved_data["width"] = width;
    ctx->saved_data["threshold"] = threshold;
    ctx->saved_data["cache_sparse"] = cache_sparse;
    ctx->saved_data["cached"] = weight.defined();
    ctx->saved_data["bag"] = bag;
    ctx->saved_data["mean"] = mean;
    std::vector<int64_t> flags(sparse.begin(), sparse.end());
    ctx->saved_data["sparse"] = flags;
    if (weight.defined()) {
      ctx->saved_data["weight_rows"] = weight.size(0);
      ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const int64_t order = ctx->saved_data["order"].toInt(), hits = ctx->saved_data["hits"].toInt();
    const int64_t width = ctx->saved_data["width"].toInt();
    const bool cached = ctx->saved_data["cached"].toBool();
    const auto flags = ctx->saved_data["sparse"].toIntVector();
    auto work = saved[0];
    std::vector<at::Tensor> cores(saved.begin() + 1, saved.begin() + 1 + order);
    std::vector<at::Tensor> gates(saved.begin() + 1 + order, saved.end());
    const int64_t count = work.size(1), misses = count - hits;
    auto grad = grad_outputs[0].to(cores[0].scalar_type()).contiguous();
    Shape shape(cores);
    // edges: ids 0, index 1, cache_weight 2, cores 3.., gates after them
    at::Tensor hit_grad, gate_grad;
    if (cached && ctx->needs_input_grad(2)) hit_grad = at::empty({hits, width}, grad.options());
    std::vector<at::Tensor> dense(order), rows(order);
    for (int64_t k = 0; k < order; ++k) {
      if (!ctx->needs_input_grad(3 + k)) continue;
      bool sparse = flags[flags.size() == 1 ? 0 : k];
      if (sparse) rows[k] = at::empty({misses, cores[k][0].numel()}, grad.options());
      else dense[k] = at::empty(cores[k].sizes(), grad.options());  // written whole
    }
    bool wants_gates = false;
    int64_t gate_total = 0;
    for (size_t g = 0; g < gates.size(); ++g) {
      wants_gates = wants_gates || ctx->needs_input_grad(3 + order + g);
      gate_total += gates[g].numel();
    }
    if (wants_gates) gate_grad = at::empty({gate_total}, grad.options());
    AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "comera_tt_lookup_backward", [&] {
      auto core_ptrs = pointers<scalar_t>(cores);
      auto gate_ptrs = pointers<scalar_t>(gates);
      std::vector<scalar_t*> dense_ptrs, row_ptrs;
      for (int64_t k = 0; k < order; ++k) {
        dense_ptrs.push_back(maybe<scalar_t>(dense[k]));
        row_ptrs.push_back(maybe<scalar_t>(rows[k]));
      }
      int status = Kernels<scalar_t>::grads(
          at::get_num_threads(), width, grad.data_ptr<scalar_t>(), hits,
          work[0].data_ptr<int64_t>(), maybe<scalar_t>(hit_grad), misses,
          work[2].data_ptr<int64_t>(), work[3].data_ptr<int64_t>(), count,
          static_cast<int>(order), shape.m.data(), shape.n.data(), shape.r.data(),
          core_ptrs.data(), gates.empty() ? nullptr : gate_ptrs.data(),
          ctx->saved_data["threshold"].toDouble(), dense_ptrs.data(), row_ptrs.data(),
          maybe<scalar_t>(gate_grad), ctx->saved_data["bag"].toInt(),
          ctx->saved_data["mean"].toBool() ? 1 : 0);
      TORCH_CHECK(status == 0, "the C lookup could not allocate its scratch rows");
    });
    variable_list out(3 + order + gates.size() + kSettings);
    if (hit_grad.defined()) {
      const int64_t rows_held = ctx->saved_data["weight_rows"].toInt();
      auto dtype = static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
      auto slots = work[1].narrow(0, 0, hits);
      auto values = hit_grad.to(dtype);
      if (ctx->saved_data["cache_sparse"].toBool()) {
        out[2] = at::_sparse_coo_tensor_unsafe(slots.unsqueeze(0), values, {rows_held, width});
      } else {
        out[2] = at::zeros({rows_held, width}, values.options()).index_add_(0, slots, values);
      }
    }
    for (int64_t k = 0; k < order; ++k) {
      if (dense[k].defined()) {
        out[3 + k] = dense[k];
      } else if (rows[k].defined()) {
        auto values = rows[k].view(
            {misses, cores[k].size(1), cores[k].size(2), cores[k].size(3)});
        out[3 + k] = at::_sparse_coo_tensor_unsafe(work[3 + k].narrow(0, 0, misses).unsqueeze(0),
                                                   values, cores[k].sizes());
      }
    }
    if (gate_grad.defined()) {
      int64_t at = 0;
      for (size_t g = 0; g < gates.size(); ++g) {
        if (ctx->needs_input_grad(3 + order + g))
          out[3 + order + g] = gate_grad.narrow(0, at, gates[g].numel());
        at += gates[g].numel();
      }
    }
    return out;
  }
};

at::Tensor tt_lookup(const at::Tensor& ids, const at::Tensor& index,
                     const at::Tensor& cache_weight, at::TensorList cores, at::TensorList gates,
                     c10::List<bool> sparse, bool cache_sparse, int64_t width, int64_t limit,
                     double threshold, int64_t bits, int64_t bag, bool mean) {
  std::vector<bool> flags(sparse.begin(), sparse.end());
  return TTLookup::apply(ids, index, cache_weight, cores, gates, flags, cache_sparse, width,
                         limit, threshold, bits, bag, mean);
}

}  // namespace

TORCH_LIBRARY(comera_native, m) {
  m.def(
      "tt_lookup(Tensor ids, Tensor index, Tensor cache_weight, Tensor[] cores, "
      "Tensor[] gates, bool[] sparse, bool cache_sparse, int width, int limit, "
      "float threshold, int bits, int bag, bool mean) -> Tensor");
}

TORCH_LIBRARY_IMPL(comera_native, CompositeImplicitAutograd, m) {
  m.impl("tt_lookup", tt_lookup);
}
