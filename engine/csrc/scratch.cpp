// Scratch arrays for the kernels (kernels.h, `scratch`), kept by the thread that freed them and
// handed out again. The decode stack's threads quantize every matmul's input into scratch arrays,
// hundreds of times a token. Through malloc, threads sharing an arena (in a process with more
// threads than glibc makes arenas, 8 per core, as a Ray driver's) queued on its lock at each one,
// and a decode step took twice as long (BENCHMARKS.md, "Serving over HTTP").
#include "kernels.h"
#include <cstdlib>

namespace {

constexpr size_t kHeader = 64;            // a block's capacity, before its data (which stays 64-byte aligned)
constexpr size_t kKeptBytes = 1 << 20;    // larger blocks (prefill's) go back to malloc: their work dwarfs it
constexpr size_t kKeptBlocks = 16;        // per thread

struct Kept {
  std::vector<char*> blocks;  // freed blocks, header first
  Kept() { blocks.reserve(kKeptBlocks); }
  ~Kept() {
    for (char* block : blocks) std::free(block);
  }
};

thread_local Kept kept;

size_t capacity(const char* block) {
  size_t bytes;
  std::memcpy(&bytes, block, sizeof bytes);
  return bytes;
}

}  // namespace

void* scratch_bytes(size_t bytes) {
  for (char*& block : kept.blocks) {
    if (capacity(block) >= bytes) {
      char* found = block;
      block = kept.blocks.back();
      kept.blocks.pop_back();
      return found + kHeader;
    }
  }
  const size_t rounded = (bytes + kHeader - 1) / kHeader * kHeader;
  char* block = static_cast<char*>(std::aligned_alloc(kHeader, kHeader + rounded));
  TORCH_CHECK(block != nullptr, "out of memory for ", bytes, " bytes of kernel scratch");
  std::memcpy(block, &rounded, sizeof rounded);
  return block + kHeader;
}

void ScratchFree::operator()(void* data) const noexcept {
  if (data == nullptr) return;
  char* block = static_cast<char*>(data) - kHeader;
  if (capacity(block) <= kKeptBytes && kept.blocks.size() < kKeptBlocks) {
    kept.blocks.push_back(block);
  } else {
    std::free(block);
  }
}
