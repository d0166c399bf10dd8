#include "ops/precision.h"

namespace k3::ag::gpu {

namespace {
thread_local bool g_bf16_gemms = false;
}  // namespace

Bf16Gemms::Bf16Gemms() : saved_(g_bf16_gemms) { g_bf16_gemms = true; }
Bf16Gemms::~Bf16Gemms() { g_bf16_gemms = saved_; }
bool bf16_gemms() { return g_bf16_gemms; }
void set_bf16_gemms(bool on) { g_bf16_gemms = on; }

}  // namespace k3::ag::gpu
