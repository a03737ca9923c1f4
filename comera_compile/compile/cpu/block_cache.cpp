// A CPU allocator that keeps freed large blocks, by exact size, for the next request of
// that size (see block_cache.py for why). Smaller requests go to the allocator it replaces.
#include <c10/core/CPUAllocator.h>

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kSlack = 8;  // the cache maps at most 1 + 1/kSlack x its peak in use, when it can

struct Block {
  void* data;
  size_t size;
  size_t freed_at;  // the count of large requests when it was last freed
};

struct Stats {
  size_t mapped = 0;  // bytes mapped by the cache, in use or kept
  size_t kept = 0;    // of them, free and kept for reuse
  size_t hits = 0;
  size_t misses = 0;
  size_t unmapped = 0;  // kept blocks handed back: the cache was full, or they sat idle
  size_t peak_in_use = 0;  // the most bytes of its blocks in use at once
  size_t recycled = 0;  // misses served by resizing a kept block of another size
};

// Every pointer it hands out is its own context (as torch's default CPU allocator does),
// so kernels that allocate scratch space raw (raw_allocate / raw_deleter) work with it:
// the deleter finds a block by its address, and passes any other to the small allocator.
class BlockCache final : public c10::Allocator {
 public:
  BlockCache(c10::Allocator* small, size_t min_bytes, size_t max_kept, size_t max_idle)
      : small_(small), min_bytes_(min_bytes), max_kept_(max_kept), max_idle_(max_idle) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes_) {
      return small_->allocate(n);
    }
    size_t size = (n + kPage - 1) / kPage * kPage;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      requests_++;
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        Block* block = it->second.back();
        it->second.pop_back();
        stats_.kept -= size;
        stats_.hits++;
        sweep_if_due();  // sizes an earlier shape asked for age out while every request hits
        return hand_out(block);
      }
      stats_.misses++;
      drop_idle();  // a new size: the step changed, and sizes it no longer asks for go
      if (Block* block = recycle(size)) {
        return hand_out(block);
      }
    }
    void* data = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) {
      return small_->allocate(n);  // let the usual allocator report the failure
    }
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.mapped += size;
    return hand_out(new Block{data, size, 0});
  }

  c10::DeleterFnPtr raw_deleter() const override { return &BlockCache::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  // Hand every kept block back to the OS.
  void trim() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& entry : free_) {
      for (Block* block : entry.second) {
        unmap(block);
      }
      entry.second.clear();
    }
    stats_.kept = 0;
  }

  void set_limits(size_t max_kept, size_t max_idle) {
    std::lock_guard<std::mutex> lock(mutex_);
    max_kept_ = max_kept;
    max_idle_ = max_idle;
    next_sweep_ = requests_ + std::max<size_t>(1, max_idle_ / 8);
  }

  Stats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  c10::Allocator* small() const { return small_; }

  // fork() while another thread holds the mutex would leave the child's copy locked for
  // good: the forking thread takes it before the fork and both sides release it after.
  void lock_for_fork() { mutex_.lock(); }
  void unlock_after_fork() { mutex_.unlock(); }

  static BlockCache* instance;

 private:
  c10::DataPtr hand_out(Block* block) {  // with mutex_ held
    in_use_[block->data] = block;
    stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.mapped - stats_.kept);
    return {block->data, block->data, &BlockCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  static void release(void* ptr) {
    if (!instance->put(ptr)) {
      instance->small_->raw_deleter()(ptr);  // a small block: not one of ours
    }
  }

  bool put(void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = in_use_.find(ptr);
    if (it == in_use_.end()) {
      return false;
    }
    Block* block = it->second;
    in_use_.erase(it);
    // kept bytes stay under max_kept_ and under 1.5x the most ever in use at once, so
    // shapes that change every step cannot make the cache grow without bound
    size_t limit = std::min(max_kept_, stats_.peak_in_use + stats_.peak_in_use / 2);
    if (stats_.kept + block->size > limit) {
      stats_.unmapped++;
      unmap(block);
      return true;
    }
    block->freed_at = requests_;
    free_[block->size].push_back(block);
    stats_.kept += block->size;
    sweep_if_due();
    return true;
  }

  // On hits and frees, walk the kept blocks for idle ones once every max_idle_ / 8 large
  // requests (a miss always walks them): the walk stays rare, and a block no request takes
  // is unmapped within about 1.125 x max_idle_ requests even when no request misses.
  void sweep_if_due() {  // with mutex_ held
    if (requests_ >= next_sweep_) {
      drop_idle();
    }
  }

  // Unmap kept blocks that no request took in the last max_idle_ large requests. A size
  // left with no kept block is forgotten, so sizes that change every step do not pile up
  // entries for each later miss to walk.
  void drop_idle() {  // with mutex_ held
    next_sweep_ = requests_ + std::max<size_t>(1, max_idle_ / 8);
    for (auto entry = free_.begin(); entry != free_.end();) {
      auto& blocks = entry->second;
      size_t kept = 0;
      for (Block* block : blocks) {
        if (requests_ - block->freed_at > max_idle_) {
          stats_.kept -= block->size;
          stats_.unmapped++;
          unmap(block);
        } else {
          blocks[kept++] = block;
        }
      }
      blocks.resize(kept);
      entry = kept ? std::next(entry) : free_.erase(entry);
    }
  }

  // A miss while the cache holds more than kSlack past the most ever in use: the oldest
  // kept blocks go, and the last one is resized (mremap keeps the pages it already has)
  // to serve the request. Kept blocks of the wrong size are what fragmentation is; this
  // keeps what the cache maps near what a step really uses at once.
  Block* recycle(size_t size) {  // with mutex_ held; nullptr: map a new block
    size_t cap = stats_.peak_in_use + stats_.peak_in_use / kSlack;
    while (stats_.kept > 0 && stats_.mapped + size > cap) {
      Block* oldest = take_oldest();
      if (stats_.kept > 0 && stats_.mapped - oldest->size + size > cap) {
        unmap(oldest);
        stats_.unmapped++;
        continue;
      }
      void* data = mremap(oldest->data, oldest->size, size, MREMAP_MAYMOVE);
      if (data == MAP_FAILED) {
        unmap(oldest);
        return nullptr;
      }
      stats_.mapped = stats_.mapped - oldest->size + size;
      oldest->data = data;
      oldest->size = size;
      stats_.recycled++;
      return oldest;
    }
    return nullptr;
  }

  Block* take_oldest() {  // with mutex_ held and a block kept
    auto oldest = free_.end();
    size_t at = 0;
    for (auto entry = free_.begin(); entry != free_.end(); ++entry) {
      if (!entry->second.empty() && (oldest == free_.end() || entry->second.front()->freed_at < at)) {
        oldest = entry;
        at = entry->second.front()->freed_at;
      }
    }
    Block* block = oldest->second.front();
    oldest->second.erase(oldest->second.begin());
    if (oldest->second.empty()) free_.erase(oldest);
    stats_.kept -= block->size;
    return block;
  }

  void unmap(Block* block) {  // with mutex_ held
    munmap(block->data, block->size);
    stats_.mapped -= block->size;
    delete block;
  }

  c10::Allocator* small_;
  size_t min_bytes_;
  size_t max_kept_;
  size_t max_idle_;
  size_t requests_ = 0;  // large requests so far
  size_t next_sweep_ = 0;  // the request count at which a hit or free next walks for idle
  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<Block*>> free_;
  std::unordered_map<void*, Block*> in_use_;
  Stats stats_;
};

BlockCache* BlockCache::instance = nullptr;

void before_fork() {
  if (BlockCache::instance != nullptr) BlockCache::instance->lock_for_fork();
}

void after_fork() {
  if (BlockCache::instance != nullptr) BlockCache::instance->unlock_after_fork();
}

}  // namespace

extern "C" {

// Install the cache as torch's CPU allocator; 0 when it already was (max_kept still changes).
int comera_block_cache_install(size_t min_bytes, size_t max_kept, size_t max_idle) {
  if (BlockCache::instance != nullptr) {
    BlockCache::instance->set_limits(max_kept, max_idle);
    if (c10::GetCPUAllocator() == BlockCache::instance) return 0;
    c10::SetCPUAllocator(BlockCache::instance, /*priority=*/100);
    return 1;
  }
  // never deleted: tensors it served may outlive any owner
  BlockCache::instance = new BlockCache(c10::GetCPUAllocator(), min_bytes, max_kept, max_idle);
  pthread_atfork(&before_fork, &after_fork, &after_fork);
  c10::SetCPUAllocator(BlockCache::instance, /*priority=*/100);
  return 1;
}

// Give torch back the allocator the cache replaced; blocks it served still return to it.
int comera_block_cache_uninstall() {
  if (BlockCache::instance == nullptr || c10::GetCPUAllocator() != BlockCache::instance) {
    return 0;
  }
  BlockCache::instance->set_limits(0, 0);
  BlockCache::instance->trim();
  c10::SetCPUAllocator(BlockCache::instance->small(), /*priority=*/100);
  return 1;
}

int comera_block_cache_active() {
  return BlockCache::instance != nullptr && c10::GetCPUAllocator() == BlockCache::instance;
}

void comera_block_cache_trim() {
  if (BlockCache::instance != nullptr) BlockCache::instance->trim();
}

// mapped, kept, hits, misses, unmapped, peak_in_use, recycled
void comera_block_cache_stats(size_t* out) {
  Stats s = BlockCache::instance != nullptr ? BlockCache::instance->stats() : Stats{};
  out[0] = s.mapped;
  out[1] = s.kept;
  out[2] = s.hits;
  out[3] = s.misses;
  out[4] = s.unmapped;
  out[5] = s.peak_in_use;
  out[6] = s.recycled;
}

}  // extern "C"
