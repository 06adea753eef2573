// The experiment behind activation.h's forward shape (kForwardRows, kForwardMinBlocks): the
// fused bias + activation forward kernel on 16384 x 8192 bfloat16 with every combination of rows
// in flight per thread (the kRows template parameter) and a register cap from
// __launch_bounds__'s minimum blocks per SM, timed against cudaMemcpy of the same bytes.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I../../common/include activation_tile_shapes.cu -o tile_shapes
//   ./tile_shapes
//
// Torch-free, like the kernels: it includes the chapter's header and launches its kernel.
#include "../activation.h"
#include <course/bias_act.cuh>

#include <algorithm>
#include <cstdio>
#include <vector>

namespace {

using course::bias_act_tile_kernel;
using T = __nv_bfloat16;
constexpr int64_t kRows = 16384;
constexpr int64_t kCols = 8192;
constexpr int kPack = 8;  // bfloat16 elements in a 16-byte pack
constexpr int kReps = 20;

// Median of kReps timed launches after 5 untimed ones.
template <typename Launch>
float median_ms(Launch launch) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> times;
  for (int i = 0; i < kReps + 5; ++i) {
    cudaEventRecord(start);
    launch();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 5) times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

double gbps(float ms) { return 2.0 * kRows * kCols * sizeof(T) / (ms * 1e6); }

// One configuration: R rows in flight per thread, registers capped so that kMinBlocks blocks of
// 256 threads fit an SM (1: no cap).
template <typename Act, int R, int kMinBlocks>
void run(const T* x, const T* bias, T* y, const char* name, double copy_gbps) {
  constexpr int tx = 256;  // make_tiling's choice for 1024 packs per row
  const dim3 grid(kCols / kPack / tx, (kRows + R - 1) / R);
  auto* kernel = bias_act_tile_kernel<T, Act, kPack, false, R, kMinBlocks>;
  cudaFuncAttributes attr{};
  cudaFuncGetAttributes(&attr, kernel);
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, 0);
  const float ms = median_ms([&] { kernel<<<grid, 256>>>(x, bias, 1.0f, y, nullptr, nullptr, kRows, kCols, tx); });
  std::printf("%-10s rows %d  min blocks %d  registers %3d  blocks/SM %d  %7.1f us  %5.0f GB/s  %5.1f%% of memcpy\n",
              name, R, kMinBlocks, attr.numRegs, per_sm, ms * 1e3, gbps(ms), 100 * gbps(ms) / copy_gbps);
}

template <typename Act>
void sweep(const T* x, const T* bias, T* y, const char* name, double copy_gbps) {
  run<Act, 1, 8>(x, bias, y, name, copy_gbps);
  run<Act, 1, 4>(x, bias, y, name, copy_gbps);
  run<Act, 2, 1>(x, bias, y, name, copy_gbps);
  run<Act, 2, 4>(x, bias, y, name, copy_gbps);
  run<Act, 4, 1>(x, bias, y, name, copy_gbps);
  run<Act, 4, 4>(x, bias, y, name, copy_gbps);
}

}  // namespace

int main() {
  T* x = nullptr;
  T* y = nullptr;
  T* bias = nullptr;
  const size_t bytes = kRows * kCols * sizeof(T);
  if (cudaMalloc(&x, bytes) != cudaSuccess || cudaMalloc(&y, bytes) != cudaSuccess ||
      cudaMalloc(&bias, kCols * sizeof(T)) != cudaSuccess) {
    std::printf("cudaMalloc failed\n");
    return 1;
  }
  cudaMemset(x, 0, bytes);
  cudaMemset(bias, 0, kCols * sizeof(T));
  const double copy = gbps(median_ms([&] { cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice); }));
  std::printf("cudaMemcpy %5.0f GB/s\n", copy);
  sweep<fusion::elementwise::Silu>(x, bias, y, "silu", copy);
  sweep<fusion::elementwise::GeluTanh>(x, bias, y, "gelu_tanh", copy);
  sweep<fusion::elementwise::GeluErf>(x, bias, y, "gelu_erf", copy);
  sweep<fusion::elementwise::Relu>(x, bias, y, "relu", copy);
  const cudaError_t err = cudaGetLastError();
  std::printf("%s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
