// How the packed GEMMs (packed_gemm.cpp, packed_gemm_w8a8.cpp) share a problem's output panels among the OpenMP
// threads, and how many threads a problem gets.
#pragma once

#include <omp.h>

#include <cstdint>

namespace {

// Panels per work chunk: threads take chunks from a shared counter, so when the OS preempts one thread (the API
// server and the client share these cores) the others take over its unstarted chunks instead of waiting at the
// barrier. About 8 chunks per thread, in whole panel groups (`width` panels).
int64_t chunk_panels(int64_t panels, int threads, int width) {
  const int64_t per = panels / (int64_t{8} * threads) / width * width;
  return per > width ? per : width;
}

// The work items: whole chunks, and when their count does not divide among the threads (a narrow layer: 576
// outputs are 36 panels, 9 chunks of 4, so one of two threads would do 5), the last chunk cut into one piece per
// thread, so that the threads end together. Item c covers panels [p0, p1) (empty for a piece past the end).
struct Chunks {
  int64_t chunk, whole, piece, items;
  void range(int64_t c, int64_t panels, int64_t* p0, int64_t* p1) const {
    *p0 = c < whole ? c * chunk : whole * chunk + (c - whole) * piece;
    const int64_t end = *p0 + (c < whole ? chunk : piece);
    *p1 = end < panels ? end : panels;
    if (*p0 > panels) *p0 = panels;
  }
};

Chunks make_chunks(int64_t panels, int threads, int width) {
  const int64_t chunk = chunk_panels(panels, threads, width);
  const int64_t count = (panels + chunk - 1) / chunk;
  if (threads <= 1 || count % threads == 0) return {chunk, count, chunk, count};
  const int64_t tail = panels - (count - 1) * chunk;
  return {chunk, count - 1, (tail + threads - 1) / threads, count - 1 + threads};
}

// Threads for a problem of m * n * k multiply-adds: tiny problems stay on one, a fork costs more than they take.
int threads_for(int64_t work) {
  return work < (int64_t{1} << 18) ? 1 : omp_get_max_threads();
}

}  // namespace
