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

// One expert's share of a grouped pass: n rows of x from in_row, its GLU output to rows from out_row.
struct ExpertRows {
  int64_t expert, n, in_row, out_row;
};

// y [rows_out, W] fp32 ← each job's expert (gate, up, the GLU, down) on its rows of x [rows_in, W]:
// the operands in the GEMMs' storage, every gate and up GEMM in one grouped call, one activation
// over every row, every down GEMM in another.
device::Buffer run_experts(const std::vector<GluMlp>& experts, const std::vector<ExpertRows>& jobs, const float* x,
                           int64_t rows_in, int64_t rows_out, int64_t W, int64_t H, device::Storage st) {
  const size_t esz = st == device::Storage::BF16 ? 2 : 4;
  device::Buffer xb, gb(size_t(rows_out * H) * 4), ub(size_t(rows_out * H) * 4), ab(size_t(rows_out * H) * 4), abb,
      yb(size_t(rows_out * W) * 4);
  const void* xop = x;
  if (st == device::Storage::BF16) {
    xb = device::Buffer(size_t(rows_in * W) * 2);
    cuda::cast(x, xb.get(), rows_in * W, st);
    xop = xb.get();
  }
  auto row = [](const void* base, int64_t r, int64_t width, size_t bytes) {
    return static_cast<const char*>(base) + size_t(r * width) * bytes;
  };
  std::vector<cuda::GemmProblem> gate_up, down;
  for (const ExpertRows& j : jobs) {
    const GluMlp& e = experts[size_t(j.expert)];
    gate_up.push_back({j.n, row(xop, j.in_row, W, esz), e.gate.weight->value.raw(), gb.as<float>() + j.out_row * H});
    gate_up.push_back({j.n, row(xop, j.in_row, W, esz), e.up.weight->value.raw(), ub.as<float>() + j.out_row * H});
  }
  cuda::gemm_nt_grouped(H, W, gate_up, st);
  const SituOptions so = activation_of(experts[size_t(jobs.at(0).expert)]);
  cuda::situ_glu_forward(gb.get(), ub.get(), ab.get(), rows_out * H, so.beta.value_or(0.0f), so.beta_lin.value_or(0.0f),
                         device::Storage::F32);
  const void* aop = ab.get();
  if (st == device::Storage::BF16) {
    abb = device::Buffer(size_t(rows_out * H) * 2);
    cuda::cast(ab.as<float>(), abb.get(), rows_out * H, st);
    aop = abb.get();
  }
  for (const ExpertRows& j : jobs)
    down.push_back({j.n, row(aop, j.out_row, H, esz), experts[size_t(j.expert)].down.weight->value.raw(),
                    yb.as<float>() + j.out_row * W});
  cuda::gemm_nt_grouped(W, H, down, st);
  return yb;
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
  // Routed rows in dispatch order; expert j's are rows offsets[j] to offsets[j + 1].
  const device::Buffer d_rows = device::upload_new(d.rows.data(), d.rows.size() * 8);
  const device::Buffer d_slots = device::upload_new(d.slots.data(), d.slots.size() * 8);
  device::Buffer xp(size_t(N * W) * 4);
  cuda::gather_rows(xr.cuda_f32(), d_rows.as<int64_t>(), N, W, xp.as<float>());
  std::vector<ExpertRows> jobs;
  for (int64_t j = 0; j < d.active(); ++j) {
    const int64_t p0 = d.offsets[size_t(j)];
    jobs.push_back({d.experts[size_t(j)], d.offsets[size_t(j + 1)] - p0, p0, p0});
  }
  const device::Buffer yb = run_experts(experts, jobs, xp.as<float>(), N, N, W, H, st);
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
  // Every expert's rows are all M rows: its outputs are rows e·M to (e + 1)·M of [E·M, W].
  std::vector<ExpertRows> jobs;
  for (int64_t e = 0; e < E; ++e) jobs.push_back({e, M, 0, e * M});
  const device::Buffer yb = run_experts(experts, jobs, xr.cuda_f32(), M, E * M, W, H, st);
  dense_combine(yb.as<float>(), dense, W, out.cuda_f32());
  return out;
}

}  // namespace k3::gpu
