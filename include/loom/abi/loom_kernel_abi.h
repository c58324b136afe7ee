/* The C ABI between Loom and an external kernel library (a "provider"): the only header a vendor library includes.
 * Plain C99, no Loom C++ headers. docs/PROVIDERS.md walks through writing, building, loading and checking one.
 *
 * Lifecycle
 *   Loom dlopen()s the library and calls its one exported entry point
 *       int loom_provider_init(const LoomHost* host, LoomProvider* provider);
 *   with `provider` zeroed except provider->struct_size (the size of LoomProvider Loom knows). The library fills in
 *   its name, the ABI version it was built against (LOOM_ABI_VERSION_MAJOR/MINOR), its op table and last_error, and
 *   returns LOOM_STATUS_OK. Loom refuses a library whose major version differs from its own, or whose minor version
 *   is newer than its own; an older minor keeps working (new fields are only ever appended, before reserved slots,
 *   and every struct starts with its size so each side reads only what the other wrote). Ops are added in minor
 *   versions: the list below marks those of 1.1 with [1.1], of 1.2 with [1.2], and so on to [1.9], and Loom binds
 *   an op only for a library built against the minor that added it or a newer one (a 1.0 library that names a 1.1
 *   op is warned, as before, and the rest of its ops load). 1.3 also
 *   added the 8-bit float dtypes: only the FP8 ops take them, and a mask bit for them counts only in a library built
 *   against 1.3 or newer.
 *
 * Memory and streams belong to Loom: outputs are allocated by Loom before a call; a library that needs scratch
 * memory asks host->allocate_workspace, and runs its work on host->get_stream(device) (a cudaStream_t on CUDA, NULL
 * on the CPU). A kernel may return before its work on a stream completes; Loom orders later work on that stream.
 *
 * Every kernel has ONE signature (LoomKernelFn): input descriptors, output descriptors, named attributes. It returns
 * LOOM_STATUS_OK or an error status, with a message from provider->last_error(ctx). An op's optional supports()
 * sees the same descriptors and attributes and returns non-zero to accept the call; when it declines, Loom runs the
 * next candidate (another provider or the native kernel), so a library takes exactly the cases it is good at.
 *
 * ---------------------------------------------------------------------------------------------------------------
 * ARGUMENT ORDER (one rule for every op)
 *   inputs:  the tensors the op reads, in the order of Loom's kernel signature (src/kernels/<area>_kernel.h);
 *   outputs: the tensors the op writes, in signature order (already allocated, any content: write every element;
 *            an op that updates a buffer in place reads it there: gemm's C when beta != 0,
 *            cross_entropy_scale_grad's grad_logits, the optimizer updates' param and states);
 *   attrs:   named scalars (LoomAttr), in no particular order: look them up by name (loom_attr_* below).
 *   An optional tensor that is absent (no affine weight, say) has data == NULL (and rank 0). A backward op takes its
 *   gradients as outputs; an output with data == NULL is not needed and must not be written.
 *   A tensor with no elements (a dim of 0) is present like any other: its dtype, rank, shape and strides are what
 *   the op says (a gemm's A for k = 0 is [batch, m, 0] in A/B's dtype), and its data is NOT NULL, but points at no
 *   element: never read or write through it (it may be host memory whatever the device). So data == NULL always
 *   and only means absent. Such a tensor counts as contiguous whatever its strides (loom_desc_is_contiguous).
 *   The norms (layer_norm, rms_norm and their residual and backward forms) are never called with rows of no
 *   elements (a last dim of 0): Loom writes those results itself.
 *   Shapes and strides are in elements; data points at the first element (any view offset already applied), so
 *   data is aligned only to its element size: a matrix or vector may start at any element (do not assume 16 bytes).
 *   Special values (NaN, +-inf, -0.0, denormals) are valid inputs: each op's description says what it does with
 *   them (`loom-conformance --describe OP`), IEEE propagation unless it says otherwise.
 *   Unless an op says "any strides", Loom passes contiguous tensors.
 *   dtype masks are over the op's DISPATCH dtype (noted per op): the output's for elementwise ops, the inputs' for
 *   comparisons, the logits' for cross_entropy, A/B's (input_dtype) for gemm, x's for the fused norms (the
 *   residual's for their backward), param's for the optimizer updates.
 *
 *   Elementwise (every tensor has out's shape; inputs may be broadcast as stride-0 views: any strides; out may alias
 *   an input element for element, so read each element before writing it):
 *     neg abs exp log sqrt rsqrt tanh sigmoid gelu(tanh approx.) silu relu
 *                                                   in: x                  out: out
 *     gelu_backward silu_backward relu_backward tanh_backward sigmoid_backward
 *                                                   in: grad, saved        out: grad_x
 *                                                   (saved = forward input; forward output for tanh and sigmoid)
 *     add sub mul div maximum minimum               in: a, b               out: out
 *     eq ne lt le gt ge (out is bool; dispatch dtype = a's)
 *                                                   in: a, b               out: out
 *     add_scaled (out = a + alpha*b)                in: a, b               out: out      attrs: alpha (float)
 *     add_scalar mul_scalar div_scalar rsub_scalar(value - x) maximum_scalar minimum_scalar pow_scalar(x**value)
 *                                                   in: x                  out: out      attrs: value (float)
 *     where (cond is bool)                          in: cond, a, b         out: out
 *     swiglu (out = silu(gate) * up; gate and up have one shape and dtype, no broadcasting)
 *                                                   in: gate, up           out: out
 *     swiglu_backward (contiguous; grad_gate = grad * up * silu'(gate), grad_up = grad * silu(gate))
 *                                                   in: grad, gate, up     out: grad_gate?, grad_up?
 *   Softmax (contiguous; dim is non-negative):
 *     softmax log_softmax                           in: x                  out: out      attrs: dim (int)
 *     softmax_backward log_softmax_backward         in: grad, out          out: grad_input  attrs: dim (int)
 *   Normalization over the last dim (contiguous; mean/rstd are f32, f64 for f64 x):
 *     layer_norm                                    in: x, weight?, bias?  out: out, mean, rstd   attrs: eps (float)
 *     layer_norm_backward                           in: grad, x, weight?, mean, rstd
 *                                                   out: grad_input?, grad_weight?, grad_bias?
 *     rms_norm                                      in: x, weight?         out: out, rstd        attrs: eps (float)
 *     rms_norm_backward                             in: grad, x, weight?, rstd   out: grad_input?, grad_weight?
 *   The residual add fused into the norm [1.1] (what GPT-2 and LLaMA training call; contiguous):
 *     residual = x + delta, rounded to x's dtype, then out = norm(residual) (* weight (+ bias)). Without delta
 *     (data == NULL) the residual is x itself and the residual output has data == NULL. residual, weight and bias
 *     have x's dtype; delta and out each have x's dtype or, for an f32 x, bf16 or f16 (autocast's bf16 activations
 *     beside an f32 residual stream: decline in supports() the combinations you do not do). mean/rstd as above.
 *     residual_layer_norm                           in: x, delta?, weight?, bias?
 *                                                   out: residual?, out, mean, rstd          attrs: eps (float)
 *     residual_rms_norm                             in: x, delta?, weight?
 *                                                   out: residual?, out, rstd                attrs: eps (float)
 *     The backward: grad_out has out's dtype, grad_residual the residual's (NULL: zero). grad_x = grad_residual + the
 *     norm's input gradient in the residual's dtype; grad_delta the same values in delta's dtype. grad_weight and
 *     grad_bias (weight's dtype) are summed over rows in f32 (f64 for f64). Any of the outputs may be NULL.
 *     residual_layer_norm_backward                  in: grad_out, grad_residual?, residual, weight?, mean, rstd
 *                                                   out: grad_x?, grad_delta?, grad_weight?, grad_bias?
 *     residual_rms_norm_backward                    in: grad_out, grad_residual?, residual, weight?, rstd
 *                                                   out: grad_x?, grad_delta?, grad_weight?
 *   Losses (logits [N, V], targets [N] i32/i64; loss is f32, f64 for f64 logits; dispatch dtype = logits'):
 *     cross_entropy                                 in: logits, targets    out: loss
 *                                                   attrs: ignore_index (int), reduction (int: 0 mean, 1 sum, 2 none),
 *                                                   vocab_limit (int: the first vocab_limit columns are the classes,
 *                                                   the rest get zero gradient; -1: all V)
 *     cross_entropy_backward                        in: grad_loss, logits, targets   out: grad_logits   (same attrs)
 *     cross_entropy_with_grad [1.1] (training's loss: the forward and, from the same pass over the logits, the
 *     gradient for a loss gradient of 1; reduction 0 or 1 only, loss a scalar)
 *                                                   in: logits, targets    out: loss, grad_logits   (same attrs)
 *       grad_logits [N, V] (logits' dtype) is what cross_entropy_backward writes for grad_loss = 1. It may be the
 *       logits themselves (same data): read every logit of a row you need before writing over that row.
 *     cross_entropy_scale_grad [1.1] (grad_logits *= scale in place; dispatch dtype = grad_logits')
 *                                                   in: scale              out: grad_logits
 *       scale: one element, f32 (f64 for f64 grad_logits), read where it lives (device memory on CUDA: no host
 *       read); when it is exactly 1 the pass may be skipped. grad_logits is contiguous.
 *   Matrix product (every linear, matmul and outer in Loom goes through it):
 *     gemm  C = alpha * op(A) * op(B) + beta * C, column-major (BLAS/cuBLAS convention), strided batch.
 *                                                   in: A, B, bias?        out: C, pre_gelu?, bias_grad (epilogue 4 only)
 *       A is described as stored: shape [batch, rows, cols], strides [stride_a, 1, lda] (rows = m, cols = k; or
 *       k x m when trans_a), likewise B (k x n, or n x k when trans_b) and C ([batch, m, n], strides [stride_c, 1,
 *       ldc]). bias has m entries (output dtype). C and pre_gelu have the output dtype, which may differ from A/B's.
 *       attrs: trans_a trans_b (int 0/1), m n k lda ldb ldc batch stride_a stride_b stride_c (int),
 *              alpha beta (float), compute (int: 0 f32, 1 tf32 allowed, 2 f64),
 *              epilogue (int: 0 none, 1 bias: C[i,j] += bias[i], 2 gelu, 3 bias+gelu; pre_gelu gets C + bias
 *              before the gelu when present; 4 bias gradient of B: C as 0, and bias_grad [n] (output dtype) gets
 *              the sums over k of op(B), which is then a dense row-major [k, n] matrix (trans_b, ldb == n), batch 1,
 *              alpha 1; 5 GELU derivative: C = op(A) op(B) * gelu'(pre_gelu), pre_gelu then read (the forward's
 *              pre-activation), batch 1, beta 0). A library that does not know an epilogue value declines the call in
 *              supports().
 *       Read beta: when beta == 0 C's old content must be ignored (it may hold NaN). alpha may be 0: C = beta * C
 *       plus the epilogue (whether NaN or inf in A or B still reach C then is the library's choice, as in BLAS).
 *       k may be 0: C = beta * C plus the epilogue (the empty sum is 0; bias_grad is zeros); A and B then have no
 *       elements and are passed as any zero-size tensor is (above): A/B's dtype, shape [batch, m, 0] for A ([batch,
 *       0, m] with trans_a) and [batch, 0, n] for B ([batch, n, 0] with trans_b), strides [stride_a, 1, lda] and
 *       [stride_b, 1, ldb], data not NULL. m or n may be 0 too (C has no elements; nothing to write).
 *       A batch stride may be 0 (one matrix shared by every problem of the batch, as Loom's batched matmul passes).
 *   Attention (contiguous; q [B,H,T,D], k and v [B,Hkv,S,D]; lse [B,H,T] f32 (f64 for f64)):
 *     scaled_dot_product_attention                  in: q, k, v            out: out, lse   attrs: causal (int), scale (float)
 *     scaled_dot_product_attention_backward         in: grad_out, q, k, v, out, lse   out: grad_q, grad_k, grad_v
 *     scaled_dot_product_attention_strided [1.1], scaled_dot_product_attention_backward_strided [1.1]: the same
 *       arguments and attrs on views: every [B, H, T, D] / [B, Hkv, S, D] tensor (inputs and outputs; not lse, which
 *       stays contiguous) may have any strides for its first three dims, with unit stride along D (q, k and v the
 *       heads of one [B, T, (H + 2 Hkv) * D] projection; out and the gradients laid out as [B, T, H, D]).
 *   Loom calls a _strided op when one of its kernels accepts the views, else the plain op on contiguous copies.
 *   Embedding (dispatch dtype = weight's):
 *     embedding                                     in: weight, indices    out: out
 *     embedding_backward                            in: grad, indices      out: grad_weight
 *   Reductions (x contiguous; out contiguous in row-major order of the kept dims):
 *     sum mean max argmax norm                      in: x                  out: out   attrs: dims (ints), keepdim (int)
 *     column_sums [1.1] (a linear layer's bias gradient; dispatch dtype = matrix's)
 *                                                   in: matrix [rows, cols]   out: out [cols]
 *       out has the matrix's dtype or, for a bf16/f16 matrix, f32; sums in f32 (f64 for f64); rows == 0 gives zeros.
 *   Rotary embedding:
 *     rope                                          in: x, cos, sin        out: out   attrs: inverse (int)
 *     rope_strided [1.1] (the same on views: x and out [B, H, T, D] with unit stride along D and any other strides,
 *     each its own, e.g. the heads of a [B, T, H * D] projection; cos and sin contiguous)
 *                                                   in: x, cos, sin        out: out   attrs: inverse (int)
 *   Data movement:
 *     copy (dispatch dtype = dst's; any strides)    in: src                out: dst
 *     fill                                          in: -                  out: out   attrs: value (float)
 *   Optimizer updates [1.1] (contiguous, every tensor with param's numel; dispatch dtype = param's; grad has any
 *   floating dtype; the states are f32, f64 for an f64 param; param and the states are updated in place):
 *     adamw_update                                  in: grad               out: param, exp_avg, exp_avg_sq
 *       attrs: lr beta1 beta2 eps weight_decay (float), step (int: 1-based, this update included). As PyTorch's
 *       AdamW: param *= 1 - lr*weight_decay; m = beta1*m + (1-beta1)*g; v = beta2*v + (1-beta2)*g^2;
 *       param -= lr/(1-beta1^step) * m / (sqrt(v)/sqrt(1-beta2^step) + eps).
 *     sgd_update                                    in: grad               out: param, momentum_buffer?
 *       attrs: lr momentum weight_decay (float), first_step (int). d = g + weight_decay*param; with momentum,
 *       buf = d on the first step and momentum*buf + d afterwards, and d = buf; param -= lr*d. No buffer when
 *       momentum == 0.
 *     grad_norm_squared                             in: x                  out: out (one f64 element: sum(x^2) in f64)
 *   Added in 1.2: every op Loom declares is reachable. The packing is derived from each op's description (Loom's
 *   src/kernels/<area>_kernel.h, next to the op: `loom-conformance --describe OP` prints it), by the rule above.
 *     dropout dropout_backward [1.2]                in: x                  out: out
 *       attrs: p (float), seed offset (int: the Philox4x32-10 stream; element i of the row-major output is kept when
 *       the i-th uniform draw of the stream at (seed, offset) is >= p, and scaled by 1/(1-p))
 *     random [1.2]                                  in: -                  out: out
 *       attrs: distribution (int: 0 uniform [a, b), 1 normal (mean a, std b)), a b (float), seed offset (int)
 *     arange [1.2]                                  in: -                  out: out   attrs: start step (float)
 *     cat [1.2] (the inputs, any strides, one after another: n_inputs is their count)
 *                                                   in: inputs...          out: out   attrs: dim (int)
 *     index_select [1.2]                            in: x, index           out: out   attrs: dim (int)
 *     gather [1.2] (x any strides)                  in: x, index           out: out   attrs: dim (int)
 *     scatter_add [1.2] (out in place: out[.. index ..] += src)
 *                                                   in: index, src         out: out   attrs: dim (int)
 *     triangular [1.2]                              in: x                  out: out   attrs: diagonal (int), upper (int)
 *   Added in 1.3: the FP8 ops (src/kernels/fp8_kernel.h) and the dtypes they store in, LOOM_DTYPE_F8E4M3 and
 *   LOOM_DTYPE_F8E5M2 (one byte per element; loom/common/float8.h defines the formats and their rounding). A scale
 *   is one f32 element in the device's memory (read it there: no host read); values are q * scale_inv.
 *     fp8_amax [1.3] (dispatch dtype = x's: f32 or bf16; contiguous)
 *                                                   in: x                  out: amax (one f32: max |x|, NaN if any)
 *     fp8_scale [1.3] (dispatch dtype f32)          in: amax               out: history [H], scale, scale_inv
 *       history and scale are updated in place: history moves one place toward its end, amax enters at 0; from the
 *       largest non-NaN entry a, when finite and > 0, scale = (fp8_max / a) / 2^margin in f32 unless that is not
 *       finite and > 0; scale_inv = 1 / scale. attrs: fp8_max (float: 448 or 57344), margin (int).
 *     fp8_quantize [1.3] (dispatch dtype = q's; x f32 or bf16; contiguous)
 *                                                   in: x, scale           out: q, amax?
 *       q = the code of float(x) * scale (rounded to f32), to nearest even, saturating finite values at the
 *       format's largest; NaN stays NaN; inf stays inf in e5m2 and is NaN in e4m3. amax as fp8_amax.
 *     fp8_dequantize [1.3] (dispatch dtype = q's)   in: q, scale_inv       out: out (f32 or bf16: q * scale_inv in f32)
 *     fp8_gemm [1.3] (dispatch dtype = A's)         in: A, B, scale_a, scale_b, bias?   out: C
 *       gemm's layout and attrs (A and B as stored, column-major, any transposes) with A and B 8-bit floats (e4m3
 *       and e4m3, or one of them e5m2), C and bias bf16 or f32: C = alpha * (scale_a op(A)) (scale_b op(B)) +
 *       beta * C (+ bias[i] when epilogue == 1; epilogue is 0 or 1). scale_a and scale_b are the operands'
 *       dequantization factors (cuBLASLt's A/B_SCALE_POINTER). attr fast_accumulation (int): 1 allows a less exact,
 *       faster accumulation (cuBLASLt's FAST_ACCUM); 0 asks for f32 partial sums.
 *   Added in 1.4: the mixture-of-experts ops (src/kernels/moe_kernel.h). A token's K choices are its assignments
 *   a = t * K + j; every tensor is contiguous; probabilities, weights and their gradients are f32 (f64 for f64).
 *     moe_route [1.4] (softmax over E and the top K, ties to the lower index, chosen on the logits)
 *                                                   in: logits [T, E]      out: probs [T, E], weights [T, K],
 *                                                   experts [T, K] (i64)   attrs: renormalize (int)
 *     moe_route_backward [1.4]                      in: grad_weights, grad_probs?, probs, experts
 *                                                   out: grad_logits       attrs: renormalize (int)
 *     moe_permute [1.4] (assignments grouped by expert, in order; -1 experts are not routed)
 *                                                   in: x [T, C], experts [T, K]
 *                                                   out: out [T * K, C], rows [T, K], sources [T * K], counts [E]
 *                                                   (i64)   attrs: capacity (int; -1 none)
 *     moe_unpermute [1.4] (out[t] = sum_j weights[t, j] * y[rows[t, j]])
 *                                                   in: y [N, C], rows [T, K], weights?   out: out [T, C]
 *     moe_unpermute_backward [1.4]                  in: grad [T, C], y, rows, sources [N], weights?
 *                                                   out: grad_y? [N, C], grad_weights? [T, K]
 *     grouped_gemm [1.4] (a's rows in consecutive groups, each times its own b; rows past the groups zero)
 *                                                   in: a [M, K], b [G, K, N] ([G, N, K] when trans_b)
 *                                                   out: c [M, N]   attrs: group_sizes (ints), trans_b (int)
 *     grouped_gemm_weight_grad [1.4]                in: a [M, K], grad [M, N]
 *                                                   out: grad_b [G, K, N] ([G, N, K] when trans_b)  (same attrs)
 *       grad_b has a's dtype or, for bf16/f16 a and grad, f32 (check its descriptor; sums in f32 either way).
 *   Added in 1.5: AdamW on clipped gradients, so that clipping's multiply rides in the update's pass.
 *     adamw_update_scaled [1.5]                     in: grad, grad_scale   out: param, exp_avg, exp_avg_sq
 *       adamw_update's attrs and update on g = grad * grad_scale as an in-place multiply of grad would store it:
 *       grad_scale is one f64 element in the device's memory (read it there: no host read), rounded to f32 (f64 for
 *       an f64 grad); the product in that type, rounded to grad's dtype. grad is not written. A library without it
 *       keeps serving adamw_update: Loom then multiplies the gradients first.
 *   Added in 1.6: quantization where the values are made, so that an FP8 product's operand is never written in 16
 *   bits first.
 *     swiglu_quantize [1.6] (dispatch dtype = q's; gate and up f32 or bf16, one dtype, [R, C] with unit column
 *       strides and row strides of their own; q contiguous)
 *                                                   in: gate, up, scale    out: q, amax?
 *       v = swiglu(gate, up) as swiglu stores it in gate's dtype; q and amax as fp8_quantize gives them for v. A
 *       library without it keeps serving swiglu: Loom then quantizes swiglu's output with fp8_quantize.
 *     residual_rms_norm_quantize [1.6] (dispatch dtype = x's: f32 or bf16; q f8e4m3 or f8e5m2)
 *                                                   in: x, delta?, weight?, scale   out: residual?, q, rstd, amax?
 *       residual_rms_norm with out in bf16 (attr eps), whose out is not written: q and amax as fp8_quantize gives
 *       them for it. A library without it keeps serving residual_rms_norm, then fp8_quantize.
 *   Added in 1.7: the same for GPT-2's block, whose FP8 products read a layer norm's output and GELU's, and the
 *   output gradients' codes written with their transpose (by GELU's and SwiGLU's backwards and the loss too).
 *     residual_layer_norm_quantize [1.7] (dispatch dtype = x's: f32 or bf16; q f8e4m3 or f8e5m2)
 *                                                   in: x, delta?, weight?, bias?, scale
 *                                                   out: residual?, q, mean, rstd, amax?
 *       residual_layer_norm with out in bf16 (attr eps), whose out is not written: q and amax as fp8_quantize gives
 *       them for it. A library without it keeps serving residual_layer_norm, then fp8_quantize.
 *     gelu_quantize [1.7] (dispatch dtype = q's; x f32 or bf16, contiguous, flattened to [N])
 *                                                   in: x, scale    out: q, amax?
 *       v = gelu(x) as gelu stores it in x's dtype; q and amax as fp8_quantize gives them for v. A library without
 *       it keeps serving gelu: Loom then quantizes gelu's output with fp8_quantize.
 *     fp8_quantize_transposed [1.7] (dispatch dtype = q's; x f32 or bf16, contiguous [R, C])
 *                                                   in: x, scale    out: q [R, C], qt [C, R], amax?
 *       fp8_quantize's codes written twice, as x is laid out and transposed (an FP8 weight gradient reads its
 *       output gradient's codes along the rows). A library without it: Loom quantizes, then transposes the codes.
 *     gelu_backward_quantize [1.7] (dispatch dtype = q's; grad and x f32 or bf16, one dtype, contiguous [R, C])
 *                                                   in: grad, x, scale    out: q [R, C], qt [C, R], amax?, column_sums?
 *       v = gelu_backward(grad, x) as that op stores it in x's dtype, never written: q, qt and amax as
 *       fp8_quantize_transposed gives them for v; column_sums [C] f32 the sums of v's columns (any fixed order of
 *       the rows that depends only on the shape). A library without it keeps serving gelu_backward: Loom then
 *       quantizes and sums its output apart.
 *     swiglu_backward_quantize [1.7] (dispatch dtype = q_gate's; grad, gate and up f32 or bf16, one dtype,
 *       contiguous [R, C])
 *                                                   in: grad, gate, up, scale_gate, scale_up
 *                                                   out: q_gate, qt_gate, q_up, qt_up, amax_gate?, amax_up?
 *       (dg, du) = swiglu_backward(grad, gate, up) as that op stores them in gate's dtype, never written: each one's
 *       codes in both layouts and amax as fp8_quantize_transposed gives them for its own scale. A library without it
 *       keeps serving swiglu_backward: Loom then quantizes its two outputs apart.
 *     cross_entropy_with_grad_quantize [1.7] (dispatch dtype = logits': f32 or bf16; q f8e4m3 or f8e5m2)
 *                                                   in: logits, targets, scale   out: loss, q [N, V], amax?
 *       cross_entropy_with_grad's attrs and loss; q the codes of its gradient (for a loss gradient of 1, as it
 *       stores it in the logits' dtype) as fp8_quantize gives them, amax theirs. A library without it keeps
 *       serving cross_entropy_with_grad: Loom then quantizes its gradient apart.
 *   Added in 1.8: a plain FP8 product's bias gradient in its output gradient's cast.
 *     fp8_quantize_transposed_sums [1.8] (dispatch dtype = q's; x f32 or bf16, contiguous [R, C])
 *                                                   in: x, scale    out: q [R, C], qt [C, R], amax?, column_sums
 *       fp8_quantize_transposed's q, qt and amax; column_sums [C] f32 the sums of x's columns (any fixed order of the
 *       rows that depends only on the shape; zeros with no rows). A library without it: Loom quantizes and sums
 *       apart.
 *   Added in 1.9: the amax alone of what a fused cast would quantize, nothing written, for current scaling (whose
 *   scale needs the amax before the codes): the amax pass, then the fused cast, and the values never written.
 *     swiglu_amax [1.9] (dispatch dtype = gate's: f32 or bf16; gate and up as swiglu_quantize takes them)
 *                                                   in: gate, up    out: amax
 *       swiglu_quantize's amax of v = swiglu(gate, up). A library without it: Loom makes swiglu's output and takes
 *       its amax (fp8_amax) when it serves swiglu_quantize; Loom uses it only where the same library runs swiglu
 *       and swiglu_quantize.
 *     swiglu_backward_amax [1.9] (dispatch dtype = gate's; grad, gate and up f32 or bf16, one dtype, contiguous [R, C])
 *                                                   in: grad, gate, up    out: amax_gate, amax_up
 *       swiglu_backward_quantize's two amaxes, of dg and du. Used as swiglu_amax is.
 *     gelu_amax [1.9] (dispatch dtype = x's: f32 or bf16; x contiguous, flattened to [N])
 *                                                   in: x    out: amax
 *       gelu_quantize's amax of v = gelu(x). Used as swiglu_amax is.
 *     gelu_backward_amax [1.9] (dispatch dtype = x's; grad and x f32 or bf16, one dtype, contiguous [R, C])
 *                                                   in: grad, x    out: amax
 *       gelu_backward_quantize's amax. Used as swiglu_amax is.
 *     cross_entropy_grad_amax [1.9] (dispatch dtype = logits': f32 or bf16)
 *                                                   in: logits, targets    out: amax
 *       cross_entropy_with_grad_quantize's attrs and amax of the gradient it would quantize; no loss, no codes.
 *   A new op reaches libraries in the minor version that adds it; a library built against an older minor that names
 *   it is warned and the rest of its ops load.
 * ---------------------------------------------------------------------------------------------------------------
 */
#ifndef LOOM_KERNEL_ABI_H_
#define LOOM_KERNEL_ABI_H_

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LOOM_ABI_VERSION_MAJOR 1
#define LOOM_ABI_VERSION_MINOR 9

#define LOOM_MAX_DIMS 8

#if defined(_WIN32)
#define LOOM_PROVIDER_EXPORT __declspec(dllexport)
#else
#define LOOM_PROVIDER_EXPORT __attribute__((visibility("default")))
#endif

/* Status codes: every function that can fail returns one. */
enum {
  LOOM_STATUS_OK = 0,
  LOOM_STATUS_ERROR = 1,           /* details in last_error() */
  LOOM_STATUS_INVALID_ARGUMENT = 2,
  LOOM_STATUS_UNSUPPORTED = 3,     /* only from init: the library cannot run with this host */
  LOOM_STATUS_OUT_OF_MEMORY = 4
};

/* Element types: the values match loom::DType. */
typedef enum LoomDType {
  LOOM_DTYPE_F32 = 0,
  LOOM_DTYPE_F64 = 1,
  LOOM_DTYPE_F16 = 2,
  LOOM_DTYPE_BF16 = 3,
  LOOM_DTYPE_I8 = 4,
  LOOM_DTYPE_U8 = 5,
  LOOM_DTYPE_I32 = 6,
  LOOM_DTYPE_I64 = 7,
  LOOM_DTYPE_BOOL = 8,
  LOOM_DTYPE_F8E4M3 = 9,  /* [1.3] OCP FP8 E4M3 ("e4m3fn": no inf, NaN 0x7f/0xff, max 448) */
  LOOM_DTYPE_F8E5M2 = 10  /* [1.3] OCP FP8 E5M2 (IEEE-like: inf 0x7c/0xfc, max 57344) */
} LoomDType;
#define LOOM_DTYPE_BIT(t) (1u << (unsigned)(t))

/* Device types: the values match loom::DeviceType. A device registered through a LoomRuntime gets a slot >= 2 at
 * load time; an op entry names it with LOOM_DEVICE_OWN. */
enum {
  LOOM_DEVICE_CPU = 0,
  LOOM_DEVICE_CUDA = 1,
  LOOM_DEVICE_OWN = -1 /* op entries only: the device this library's runtime table registers */
};

/* A tensor: a view of memory Loom owns. data == NULL means the tensor is absent (or, as an output, not needed); a
 * present tensor with no elements has its dtype, shape and strides and a data pointer that is not NULL and that
 * nothing may be read or written through. */
typedef struct LoomTensorDesc {
  uint32_t struct_size;
  int32_t dtype;        /* LoomDType */
  int32_t device_type;  /* LOOM_DEVICE_CPU, LOOM_DEVICE_CUDA, or a registered slot */
  int32_t device_index;
  int32_t rank;         /* 0 .. LOOM_MAX_DIMS */
  int32_t reserved0;
  void* data;           /* the first element */
  int64_t shape[LOOM_MAX_DIMS];   /* entries past rank are 0 */
  int64_t strides[LOOM_MAX_DIMS]; /* in elements; entries past rank are 0 */
  uint64_t reserved[4];
} LoomTensorDesc;

typedef enum LoomAttrKind {
  LOOM_ATTR_INT = 0,   /* also bools (0/1) and enums */
  LOOM_ATTR_FLOAT = 1,
  LOOM_ATTR_INTS = 2   /* an int64 array */
} LoomAttrKind;

/* A named attribute: a scalar or a small int array. Strings are static and NUL-terminated. */
typedef struct LoomAttr {
  uint32_t struct_size;
  int32_t kind; /* LoomAttrKind */
  const char* name;
  int64_t i;
  double f;
  const int64_t* ints;
  int64_t n_ints;
  uint64_t reserved[2];
} LoomAttr;

/* The one kernel signature. ctx is LoomProvider.ctx. Returns a LOOM_STATUS_*. */
typedef int (*LoomKernelFn)(void* ctx, const LoomTensorDesc* inputs, int n_inputs, const LoomTensorDesc* outputs,
                            int n_outputs, const LoomAttr* attrs, int n_attrs);
/* Optional: non-zero accepts the call, zero declines it (Loom then tries the next candidate). Must not fail. */
typedef int (*LoomSupportsFn)(void* ctx, const LoomTensorDesc* inputs, int n_inputs, const LoomTensorDesc* outputs,
                              int n_outputs, const LoomAttr* attrs, int n_attrs);

/* One op a library implements on one device type. */
typedef struct LoomOpEntry {
  uint32_t struct_size;
  int32_t device_type;      /* LOOM_DEVICE_CPU, LOOM_DEVICE_CUDA or LOOM_DEVICE_OWN */
  const char* op;           /* Loom's op name: "gemm", "add", "softmax", ... (see the list above) */
  uint32_t dtypes;          /* mask of LOOM_DTYPE_BIT(dispatch dtype) */
  int32_t priority;         /* among candidates when no policy routes the op; native kernels have 0 */
  LoomKernelFn fn;
  LoomSupportsFn supports;  /* may be NULL: accepts every call with a dtype in the mask */
  void* reserved[4];
} LoomOpEntry;

/* Log levels for LoomHost.log. */
enum { LOOM_LOG_DEBUG = 0, LOOM_LOG_INFO = 1, LOOM_LOG_WARNING = 2, LOOM_LOG_ERROR = 3 };

/* What Loom offers a library. Valid from init until the library is unloaded. */
typedef struct LoomHost {
  uint32_t struct_size;
  uint32_t abi_major;  /* the ABI Loom implements */
  uint32_t abi_minor;
  uint32_t reserved0;
  void* host_ctx;      /* pass back to every callback */
  /* The stream the current call runs on (cudaStream_t for CUDA; NULL on the CPU or for the default stream). */
  void* (*get_stream)(void* host_ctx, int32_t device_type, int32_t device_index);
  /* Scratch memory from Loom's allocator (caching on CUDA). Free it before the kernel returns or keep it across
   * calls; NULL when out of memory. */
  void* (*allocate_workspace)(void* host_ctx, int32_t device_type, int32_t device_index, size_t bytes);
  void (*free_workspace)(void* host_ctx, int32_t device_type, int32_t device_index, void* ptr);
  void (*log)(void* host_ctx, int32_t level, const char* message);
  void* reserved[8];
} LoomHost;

enum { LOOM_COPY_HOST_TO_DEVICE = 0, LOOM_COPY_DEVICE_TO_HOST = 1, LOOM_COPY_DEVICE_TO_DEVICE = 2,
       LOOM_COPY_HOST_TO_HOST = 3 };

/* A device Loom does not know: a library that fills LoomProvider.runtime registers a new device type named
 * device_name ("npu"), usable as Device::parse("npu:0"), with tensors allocated and copied through these calls.
 * Streams and events are opaque handles (NULL = the device's default stream). Optional entries may be NULL. */
typedef struct LoomRuntime {
  uint32_t struct_size;
  uint32_t reserved0;
  const char* device_name;
  void* ctx;
  int32_t (*device_count)(void* ctx);
  void* (*allocate)(void* ctx, int32_t device_index, size_t bytes);  /* NULL when out of memory */
  void (*free)(void* ctx, int32_t device_index, void* ptr);
  int (*copy)(void* ctx, int32_t device_index, void* dst, const void* src, size_t bytes, int32_t kind);
  int (*synchronize)(void* ctx, int32_t device_index);
  /* Optional. */
  void* (*current_stream)(void* ctx, int32_t device_index);
  void* (*create_stream)(void* ctx, int32_t device_index);
  void (*destroy_stream)(void* ctx, int32_t device_index, void* stream);
  void (*set_current_stream)(void* ctx, int32_t device_index, void* stream);
  void* (*create_event)(void* ctx, int32_t device_index);
  void (*destroy_event)(void* ctx, int32_t device_index, void* event);
  int (*record_event)(void* ctx, int32_t device_index, void* event, void* stream);
  int (*wait_event)(void* ctx, int32_t device_index, void* stream, void* event); /* the stream waits */
  int (*synchronize_event)(void* ctx, int32_t device_index, void* event);
  void* reserved[8];
} LoomRuntime;

/* What a library fills in at init. */
typedef struct LoomProvider {
  uint32_t struct_size; /* set by Loom */
  uint32_t abi_major;   /* set by the library: LOOM_ABI_VERSION_MAJOR */
  uint32_t abi_minor;   /* set by the library: LOOM_ABI_VERSION_MINOR */
  uint32_t reserved0;
  const char* name;     /* the provider name policies route to: "acme" */
  const char* version;  /* the library's own version string, for logs; may be NULL */
  void* ctx;            /* passed to every kernel, supports and last_error */
  const LoomOpEntry* ops;
  int32_t n_ops;
  int32_t reserved1;
  /* The message of the last failure on the calling thread ("" when none). Required. */
  const char* (*last_error)(void* ctx);
  /* Called once before the library is unloaded; may be NULL. */
  void (*shutdown)(void* ctx);
  const LoomRuntime* runtime; /* a new device type, or NULL */
  void* reserved[8];
} LoomProvider;

typedef int (*LoomProviderInitFn)(const LoomHost* host, LoomProvider* provider);
#define LOOM_PROVIDER_INIT_SYMBOL "loom_provider_init"

/* ---- Helpers for libraries (header-only). ---- */

static inline const LoomAttr* loom_attr_find(const LoomAttr* attrs, int n_attrs, const char* name) {
  for (int i = 0; i < n_attrs; ++i)
    if (attrs[i].name && strcmp(attrs[i].name, name) == 0) return &attrs[i];
  return NULL;
}
static inline int64_t loom_attr_int(const LoomAttr* attrs, int n_attrs, const char* name, int64_t fallback) {
  const LoomAttr* a = loom_attr_find(attrs, n_attrs, name);
  if (!a) return fallback;
  return a->kind == LOOM_ATTR_FLOAT ? (int64_t)a->f : a->i;
}
static inline double loom_attr_float(const LoomAttr* attrs, int n_attrs, const char* name, double fallback) {
  const LoomAttr* a = loom_attr_find(attrs, n_attrs, name);
  if (!a) return fallback;
  return a->kind == LOOM_ATTR_FLOAT ? a->f : (double)a->i;
}
static inline int64_t loom_desc_numel(const LoomTensorDesc* t) {
  int64_t n = 1;
  for (int d = 0; d < t->rank; ++d) n *= t->shape[d];
  return n;
}
/* A tensor with no elements is contiguous whatever its strides: it has no layout. */
static inline int loom_desc_is_contiguous(const LoomTensorDesc* t) {
  int64_t expected = 1;
  if (loom_desc_numel(t) == 0) return 1;
  for (int d = t->rank - 1; d >= 0; --d) {
    if (t->shape[d] != 1 && t->strides[d] != expected) return 0;
    expected *= t->shape[d];
  }
  return 1;
}

/* The entry point a library exports. */
LOOM_PROVIDER_EXPORT int loom_provider_init(const LoomHost* host, LoomProvider* provider);

#ifdef __cplusplus
}
#endif

#endif /* LOOM_KERNEL_ABI_H_ */
