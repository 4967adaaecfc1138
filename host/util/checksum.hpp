#pragma once
// CRC-32C (Castagnoli) of bytes and files: the checksum checkpoints record
// for each of their files, so a damaged one is found before it is trusted.
// Uses the processor's crc32 instruction where it has one (SSE 4.2).

#include <cstddef>
#include <cstdint>
#include <filesystem>

namespace wick {

/// Continues `crc` (start with 0) over n bytes.
std::uint32_t crc32c_extend(std::uint32_t crc, const void* data, std::size_t n);

/// The CRC-32C of a whole file, and its size; throws wick::Error naming the
/// file when it cannot be read.
std::uint32_t crc32c_file(const std::filesystem::path& file, std::uint64_t* bytes = nullptr);

}  // namespace wick
