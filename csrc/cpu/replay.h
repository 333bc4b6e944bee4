// Kept-set log-probabilities on the CPU: z[a] - logsumexp(z[kept]) per row of logits, z = logits / temperature in
// float32, and its gradient, reading and writing only the kept entries (plus zeroing the gradient's rows). The
// executable specification is syncd/ops/reference/replay.py; syncd/ops/replay validates every input (shapes,
// ranges, ascending ids per row, the target inside its kept set) before calling these.
#pragma once

#include <cstddef>
#include <cstdint>

namespace syncd {
namespace replay {

// Row t reads logits[t * row_stride + ids[offsets[t] .. offsets[t+1])] (dtype_code: 1 bf16, 2 f16, 3 f32) and
// writes the scaled kept logits zk[offsets[t] ..] (what the backward needs, so the logits can be freed),
// logprob[t] and lse[t] (all float32). Returns the first row whose target is not among its kept ids, or -1.
int64_t kept_forward(const void* logits, int dtype_code, int64_t rows, int64_t row_stride, const int64_t* ids,
                     const int64_t* offsets, const int64_t* targets, float temperature, float* logprob, float* lse,
                     float* zk, int threads);

// grad_logits (rows x vocab, contiguous, dtype_code) := 0, then at the kept entries of row t
// grad[t] * ((id == target) - exp(zk - lse[t])) / temperature.
void kept_backward(const float* grad, const float* zk, int64_t rows, int64_t vocab, const int64_t* ids,
                   const int64_t* offsets, const int64_t* targets, const float* lse, float temperature,
                   void* grad_logits, int dtype_code, int threads);

}  // namespace replay
}  // namespace syncd
