#include "ffn/moe_cuda.h"

#include "core/device.h"
#include "ops/ops_cuda.h"

namespace k3::gpu {

namespace {
// The experts' hidden width and GEMM storage, after checking that the listed experts' weights are
// bias-free [out, in] device weights of one dtype that fit `W` inputs.
std::pair<int64_t, device::Storage> check_experts(const std::vector<GluMlp>& experts, const std::vector<int64_t>& ids,
                                                  int64_t W) {
  const int64_t H = experts.at(size_t(ids.at(0))).gate.weight->value.dim(0);
  const DType wt = experts.at(size_t(ids[0])).gate.weight->value.dtype();
  for (int64_t e : ids) {
    const GluMlp& x = experts.at(size_t(e));
    for (const Linear* l : {&x.gate, &x.up, &x.down}) {
      const Tensor& t = l->weight->value;
      K3_CHECK(t.device() == Device::CUDA && t.dtype() == wt && !l->bias && l->layout == WeightLayout::OutIn, "moe: expert ",
               e, " weight ", t.describe(), " is not a bias-free [out, in] ", dtype_name(wt), " device weight");
    }
    K3_CHECK(x.gate.weight->value.shape() == Shape({H, W}) && x.up.weight->value.shape() == Shape({H, W}) &&
                 x.down.weight->value.shape() == Shape({W, H}),
             "moe: expert ", e, " weights do not match [", H, ", ", W, "]");
  }
  return {H, wt == DType::BF16 ? device::Storage::BF16 : device::Storage::F32};
}

SituOptions activation_of(const GluMlp& e) {
  return e.opts.activation == GluActivation::SiTU ? e.opts.situ : SituOptions::silu();
}
}  // namespace

Tensor moe_routed(const Tensor& xr, const ag::Dispatch& d, const Tensor& w, const std::vector<GluMlp>& experts,
                  int64_t M) {
  K3_CHECK(xr.device() == Device::CUDA && w.device() == Device::CUDA, "moe: inputs ", xr.describe(), ", ",
           w.describe(), " are not both on the device");
  K3_CHECK(xr.ndim() == 2 && xr.dim(0) == M && xr.is_contiguous(), "moe: routed input ", xr.describe(), " for ", M,
           " tokens");
  const int64_t W = xr.dim(1), N = d.offsets.empty() ? 0 : d.offsets.back();
  K3_CHECK(int64_t(d.rows.size()) == N && int64_t(d.slots.size()) == N, "moe: dispatch of ", d.rows.size(), " rows");
  Tensor out = Tensor::empty_on(Device::CUDA, {M, W});
  if (out.numel()) device::zero(out.raw(), out.nbytes());
  if (N == 0) return out;
  const auto [H, st] = check_experts(experts, d.experts, W);
  const size_t esz = st == device::Storage::BF16 ? 2 : 4;
  // Routed rows in dispatch order, in the GEMM operand type.
  const device::Buffer d_rows = device::upload_new(d.rows.data(), d.rows.size() * 8);
  const device::Buffer d_slots = device::upload_new(d.slots.data(), d.slots.size() * 8);
  device::Buffer xp(size_t(N * W) * 4), xpb, gb(size_t(N * H) * 4), ub(size_t(N * H) * 4), ab(size_t(N * H) * 4), abb,
      yb(size_t(N * W) * 4);
  cuda::gather_rows(xr.cuda_f32(), d_rows.as<int64_t>(), N, W, xp.as<float>());
  const void* xop = xp.get();
  if (st == device::Storage::BF16) {
    xpb = device::Buffer(size_t(N * W) * 2);
    cuda::cast(xp.as<float>(), xpb.get(), N * W, st);
    xop = xpb.get();
  }
  auto row = [](const void* base, int64_t r, int64_t width, size_t bytes) {
    return static_cast<const char*>(base) + size_t(r * width) * bytes;
  };
  std::vector<cuda::GemmProblem> gate_up, down;
  for (int64_t j = 0; j < d.active(); ++j) {
    const GluMlp& x = experts[size_t(d.experts[size_t(j)])];
    const int64_t p0 = d.offsets[size_t(j)], n = d.offsets[size_t(j + 1)] - p0;
    gate_up.push_back({n, row(xop, p0, W, esz), x.gate.weight->value.raw(), gb.as<float>() + p0 * H});
    gate_up.push_back({n, row(xop, p0, W, esz), x.up.weight->value.raw(), ub.as<float>() + p0 * H});
  }
  cuda::gemm_nt_grouped(H, W, gate_up, st);
  const SituOptions so = activation_of(experts[size_t(d.experts[0])]);
  cuda::situ_glu_forward(gb.get(), ub.get(), ab.get(), N * H, so.beta.value_or(0.0f), so.beta_lin.value_or(0.0f),
                         device::Storage::F32);
  const void* aop = ab.get();
  if (st == device::Storage::BF16) {
    abb = device::Buffer(size_t(N * H) * 2);
    cuda::cast(ab.as<float>(), abb.get(), N * H, st);
    aop = abb.get();
  }
  for (int64_t j = 0; j < d.active(); ++j) {
    const GluMlp& x = experts[size_t(d.experts[size_t(j)])];
    const int64_t p0 = d.offsets[size_t(j)], n = d.offsets[size_t(j + 1)] - p0;
    down.push_back({n, row(aop, p0, H, esz), x.down.weight->value.raw(), yb.as<float>() + p0 * W});
  }
  cuda::gemm_nt_grouped(W, H, down, st);
  cuda::scatter_weighted(yb.as<float>(), d_rows.as<int64_t>(), d_slots.as<int64_t>(), w.cuda_f32(), N, W,
                         out.cuda_f32());
  return out;
}

Tensor moe_dense(const Tensor& xr, const Tensor& dense, const std::vector<GluMlp>& experts) {
  const int64_t M = xr.dim(0), W = xr.dim(1), E = int64_t(experts.size());
  K3_CHECK(xr.device() == Device::CUDA && xr.ndim() == 2 && xr.is_contiguous() && dense.device() == Device::CUDA &&
               dense.shape() == Shape({M, E}),
           "moe: dense routing of ", xr.describe(), " by ", dense.describe(), " over ", E, " experts");
  Tensor out = Tensor::empty_on(Device::CUDA, {M, W});
  if (M == 0 || E == 0) return out;
  std::vector<int64_t> all(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) all[size_t(e)] = e;
  const auto [H, st] = check_experts(experts, all, W);
  const size_t esz = st == device::Storage::BF16 ? 2 : 4;
  // Every expert's rows are all M rows: gate and up [E, M, H], the GLU, down [E, M, W].
  const void* xop = xr.raw();
  device::Buffer xb, gb(size_t(E * M * H) * 4), ub(size_t(E * M * H) * 4), ab(size_t(E * M * H) * 4), abb,
      yb(size_t(E * M * W) * 4);
  if (st == device::Storage::BF16) {
    xb = device::Buffer(size_t(M * W) * 2);
    cuda::cast(xr.cuda_f32(), xb.get(), M * W, st);
    xop = xb.get();
  }
  std::vector<cuda::GemmProblem> gate_up, down;
  for (int64_t e = 0; e < E; ++e) {
    gate_up.push_back({M, xop, experts[size_t(e)].gate.weight->value.raw(), gb.as<float>() + e * M * H});
    gate_up.push_back({M, xop, experts[size_t(e)].up.weight->value.raw(), ub.as<float>() + e * M * H});
  }
  cuda::gemm_nt_grouped(H, W, gate_up, st);
  const SituOptions so = activation_of(experts[0]);
  cuda::situ_glu_forward(gb.get(), ub.get(), ab.get(), E * M * H, so.beta.value_or(0.0f), so.beta_lin.value_or(0.0f),
                         device::Storage::F32);
  const void* aop = ab.get();
  if (st == device::Storage::BF16) {
    abb = device::Buffer(size_t(E * M * H) * 2);
    cuda::cast(ab.as<float>(), abb.get(), E * M * H, st);
    aop = abb.get();
  }
  for (int64_t e = 0; e < E; ++e)
    down.push_back({M, static_cast<const char*>(aop) + size_t(e * M * H) * esz,
                    experts[size_t(e)].down.weight->value.raw(), yb.as<float>() + e * M * W});
  cuda::gemm_nt_grouped(W, H, down, st);
  dense_combine(yb.as<float>(), dense, W, out.cuda_f32());
  return out;
}

}  // namespace k3::gpu
