// A fresh directory under the system temp folder, removed when the test case ends.
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>

#include "support/random_kv.hpp"

namespace floe::testing {

struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    static std::atomic<int> counter{0};
    path = std::filesystem::temp_directory_path() /
           ("floe_io_" + std::to_string(getpid()) + "_" + std::to_string(seed() % 100000) + "_" +
            std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  std::filesystem::path operator/(const std::string& name) const { return path / name; }
};

}  // namespace floe::testing
