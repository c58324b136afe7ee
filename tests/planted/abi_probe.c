/* abi_probe: a kernel library that records what it is handed. Its gemm and add (f32, f64, f16, bf16 on the CPU)
 * copy the call's descriptors and attributes into a record that tests read with abi_probe_last_call(), and write
 * nothing (their results are not meant to be right). gemm's supports() declines unless A and B share a dtype, as
 * vendor libraries check: the record shows whether a call reached the kernel with the descriptors the op says.
 * Plain C99, built only against the ABI header, like tests/planted/planted.c. */
#include <stdint.h>
#include <string.h>

#include "loom_kernel_abi.h"

typedef struct AbiProbeCall {
  char op[32];
  int n_in, n_out;
  LoomTensorDesc in[8], out[8];
  int64_t m, n, k;
  int calls; /* kernel calls so far, every op */
} AbiProbeCall;

static AbiProbeCall last_call;

LOOM_PROVIDER_EXPORT const AbiProbeCall* abi_probe_last_call(void) { return &last_call; }

static const char* probe_last_error(void* ctx) {
  (void)ctx;
  return "";
}

static void record(const char* op, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                   const LoomAttr* attrs, int n_attrs) {
  const int calls = last_call.calls;
  memset(&last_call, 0, sizeof last_call);
  strncpy(last_call.op, op, sizeof last_call.op - 1);
  last_call.n_in = n_in;
  last_call.n_out = n_out;
  for (int i = 0; i < n_in && i < 8; ++i) last_call.in[i] = in[i];
  for (int i = 0; i < n_out && i < 8; ++i) last_call.out[i] = out[i];
  last_call.m = loom_attr_int(attrs, n_attrs, "m", -1);
  last_call.n = loom_attr_int(attrs, n_attrs, "n", -1);
  last_call.k = loom_attr_int(attrs, n_attrs, "k", -1);
  last_call.calls = calls + 1;
}

static int probe_gemm_supports(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                               const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  (void)out;
  (void)n_out;
  (void)attrs;
  (void)n_attrs;
  return n_in >= 2 && in[0].dtype == in[1].dtype;
}

static int probe_gemm(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                      const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  record("gemm", in, n_in, out, n_out, attrs, n_attrs);
  return LOOM_STATUS_OK;
}

static int probe_add(void* ctx, const LoomTensorDesc* in, int n_in, const LoomTensorDesc* out, int n_out,
                     const LoomAttr* attrs, int n_attrs) {
  (void)ctx;
  record("add", in, n_in, out, n_out, attrs, n_attrs);
  return LOOM_STATUS_OK;
}

#define PROBE_FLOATS                                                                                            \
  (LOOM_DTYPE_BIT(LOOM_DTYPE_F32) | LOOM_DTYPE_BIT(LOOM_DTYPE_F64) | LOOM_DTYPE_BIT(LOOM_DTYPE_F16) |           \
   LOOM_DTYPE_BIT(LOOM_DTYPE_BF16))
static const LoomOpEntry probe_ops[] = {
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "gemm", PROBE_FLOATS, 0, probe_gemm, probe_gemm_supports, {0}},
    {sizeof(LoomOpEntry), LOOM_DEVICE_CPU, "add", PROBE_FLOATS, 0, probe_add, NULL, {0}},
};

LOOM_PROVIDER_EXPORT int loom_provider_init(const LoomHost* host, LoomProvider* p) {
  (void)host;
  p->abi_major = LOOM_ABI_VERSION_MAJOR;
  p->abi_minor = LOOM_ABI_VERSION_MINOR;
  p->last_error = probe_last_error;
  p->name = "abi_probe";
  p->version = "1";
  p->ops = probe_ops;
  p->n_ops = (int32_t)(sizeof probe_ops / sizeof probe_ops[0]);
  return LOOM_STATUS_OK;
}
