// A progress line on long work that has no steps of its own to show (loom-train building and loading a large model).
#pragma once

#include <chrono>
#include <condition_variable>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>

namespace loom::train {

// Progress on long work that has no steps of its own to show (building and loading a large model): "what: N s" on
// stdout every `period` while alive, from a thread of its own; nothing for work done within the first period.
class ProgressTicker {
 public:
  ProgressTicker(bool on, std::string what, std::chrono::duration<double> period) : what_(std::move(what)) {
    if (!on) return;
    thread_ = std::thread([this, period] {
      const auto start = std::chrono::steady_clock::now();
      std::unique_lock<std::mutex> lock(mutex_);
      while (!cv_.wait_for(lock, period, [this] { return done_; })) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::cout << what_ << ": " << long(s) << " s so far" << std::endl;
        said_ = true;
      }
      if (said_)
        std::cout << what_ << ": done in "
                  << long(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()) << " s"
                  << std::endl;
    });
  }
  ~ProgressTicker() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::string what_;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false, said_ = false;
};

}  // namespace loom::train
