#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "codec_core.h"
#include "kernels.cuh"

namespace syncd_cuda {

namespace {

using syncd::core::apply_value;
using syncd::core::code_value;
using syncd::core::unapply_value;

__device__ __forceinline__ uint64_t term(uint64_t w, uint64_t i) { return syncd::core::checksum_term(w, i); }

__device__ __forceinline__ uint64_t warp_sum(uint64_t v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, o);
  return v;
}

// Grid-stride over whole words with 16-byte loads where aligned; one atomicAdd per block.
__global__ void checksum_kernel(const uint8_t* __restrict__ p, size_t nbytes, unsigned long long* out) {
  size_t nwords = nbytes / 8;
  const uint64_t* w = reinterpret_cast<const uint64_t*>(p);
  uint64_t acc = 0;
  size_t tid = blockIdx.x * size_t(blockDim.x) + threadIdx.x, stride = size_t(gridDim.x) * blockDim.x;
  size_t npairs = nwords / 2;
  const ulonglong2* w2 = reinterpret_cast<const ulonglong2*>(p);
  for (size_t i = tid; i < npairs; i += stride) {
    ulonglong2 x = __ldg(w2 + i);
    acc += term(x.x, 2 * i) + term(x.y, 2 * i + 1);
  }
  if (tid == 0) {
    if (nwords & 1) acc += term(__ldg(w + nwords - 1), nwords - 1);
    size_t tail = nbytes % 8;
    if (tail) {
      uint64_t t = 0;
      for (size_t k = 0; k < tail; ++k) t |= uint64_t(p[nwords * 8 + k]) << (8 * k);
      acc += term(t, nwords);
    }
  }
  acc = warp_sum(acc);
  __shared__ uint64_t part[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) part[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < (blockDim.x >> 5) ? part[lane] : 0;
    acc = warp_sum(acc);
    if (lane == 0) atomicAdd(out, static_cast<unsigned long long>(acc));
  }
}

template <class T>
__global__ void count_kernel(const T* __restrict__ a, const T* __restrict__ b, size_t n, int64_t* counts) {
  size_t base = size_t(blockIdx.x) * kScanTile;
  int c = 0;
  for (int i = threadIdx.x; i < kScanTile; i += blockDim.x) {
    size_t j = base + i;
    if (j < n) c += a[j] != b[j];
  }
  c = __reduce_add_sync(0xFFFFFFFFu, c);
  __shared__ int part[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) part[warp] = c;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t s = 0;
    for (int k = 0; k < int(blockDim.x >> 5); ++k) s += part[k];
    counts[blockIdx.x] = s;
  }
}

// Order-preserving compaction: each pass of blockDim elements does a block-wide exclusive scan of flags.
template <class T>
__global__ void compact_kernel(const T* __restrict__ a, const T* __restrict__ b, size_t n, bool is_float,
                               const int64_t* __restrict__ offsets, int64_t* __restrict__ pos, uint64_t* __restrict__ v) {
  __shared__ int warp_tot[32];
  __shared__ int64_t running;
  if (threadIdx.x == 0) running = offsets[blockIdx.x];
  __syncthreads();
  size_t base = size_t(blockIdx.x) * kScanTile;
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int i0 = 0; i0 < kScanTile; i0 += blockDim.x) {
    size_t j = base + i0 + threadIdx.x;
    T x = 0, y = 0;
    bool ch = false;
    if (j < n) {
      x = a[j];
      y = b[j];
      ch = x != y;
    }
    unsigned ballot = __ballot_sync(0xFFFFFFFFu, ch);
    int before = __popc(ballot & ((1u << lane) - 1));
    if (lane == 0) warp_tot[warp] = __popc(ballot);
    __syncthreads();
    int woff = 0, total = 0;
    for (int k = 0; k < nwarps; ++k) {
      if (k < warp) woff += warp_tot[k];
      total += warp_tot[k];
    }
    if (ch) {
      int64_t slot = running + woff + before;
      pos[slot] = int64_t(j);
      v[slot] = code_value<T>(x, y, is_float);
    }
    __syncthreads();
    if (threadIdx.x == 0) running += total;
    __syncthreads();
  }
}

template <class T>
__global__ void scatter_kernel(T* __restrict__ t, const int64_t* __restrict__ pos, const uint64_t* __restrict__ v,
                               size_t m, bool is_float, bool forward) {
  size_t j = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (j >= m) return;
  int64_t p = pos[j];
  t[p] = forward ? apply_value<T>(t[p], v[j], is_float) : unapply_value<T>(t[p], v[j], is_float);
}

template <class F>
void by_width(int bits, F&& f) {
  switch (bits) {
    case 8: f(uint8_t{}); break;
    case 16: f(uint16_t{}); break;
    case 32: f(uint32_t{}); break;
    case 64: f(uint64_t{}); break;
    default: throw std::invalid_argument("unsupported element width " + std::to_string(bits));
  }
}

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

}  // namespace

void check_last(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

void checksum_raw(const void* data, size_t nbytes, uint64_t* out, uintptr_t stream) {
  if (!nbytes) return;
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  size_t pairs = nbytes / 16 + 1;
  size_t blocks = (pairs + 255) / 256;
  size_t cap = size_t(sms > 0 ? sms : 80) * 8;
  if (blocks > cap) blocks = cap;
  // 16-byte loads need a 16-byte aligned start; torch allocations are, slices may not be.
  if (reinterpret_cast<uintptr_t>(data) % 16) throw std::invalid_argument("checksum: data must be 16-byte aligned");
  checksum_kernel<<<unsigned(blocks), 256, 0, as_stream(stream)>>>(static_cast<const uint8_t*>(data), nbytes,
                                                                   reinterpret_cast<unsigned long long*>(out));
  check_last("checksum kernel");
}

void count_changes(const void* old_p, const void* new_p, size_t n, int bits, int64_t* counts, uintptr_t stream) {
  if (!n) return;
  unsigned grid = unsigned((n + kScanTile - 1) / kScanTile);
  by_width(bits, [&](auto tag) {
    using T = decltype(tag);
    count_kernel<T><<<grid, 256, 0, as_stream(stream)>>>(static_cast<const T*>(old_p), static_cast<const T*>(new_p), n, counts);
  });
  check_last("count kernel");
}

void compact_changes(const void* old_p, const void* new_p, size_t n, int bits, bool is_float, const int64_t* offsets,
                     int64_t* pos, uint64_t* v, uintptr_t stream) {
  if (!n) return;
  unsigned grid = unsigned((n + kScanTile - 1) / kScanTile);
  by_width(bits, [&](auto tag) {
    using T = decltype(tag);
    compact_kernel<T><<<grid, 256, 0, as_stream(stream)>>>(static_cast<const T*>(old_p), static_cast<const T*>(new_p), n,
                                                           is_float, offsets, pos, v);
  });
  check_last("compact kernel");
}

void scatter_apply(void* target, const int64_t* pos, const uint64_t* v, size_t m, int bits, bool is_float, bool forward,
                   uintptr_t stream) {
  if (!m) return;
  unsigned grid = unsigned((m + 255) / 256);
  by_width(bits, [&](auto tag) {
    using T = decltype(tag);
    scatter_kernel<T><<<grid, 256, 0, as_stream(stream)>>>(static_cast<T*>(target), pos, v, m, is_float, forward);
  });
  check_last("scatter kernel");
}

}  // namespace syncd_cuda
