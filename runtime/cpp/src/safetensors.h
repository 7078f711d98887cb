// Safetensors files: an 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets}}, then the data. Nothing is ever unpickled.
#ifndef DSV4C_SRC_SAFETENSORS_H_
#define DSV4C_SRC_SAFETENSORS_H_

#include <map>
#include <string>
#include <vector>

#include "json.h"
#include "tensor.h"

namespace dsv4c {

/// Every tensor of the file in its storage dtype (as Python's read_raw: BF16 and FP8 as raw
/// unsigned bits), each in its own aligned buffer. Throws CheckpointError with the messages of
/// dsv4c/artifact/safetensors_io.py.
std::map<std::string, Tensor> read_safetensors(const std::string& path);
/// The same tensors mapped read-only from the file instead (no data is read until used); the map
/// lives as long as one of them does.
std::map<std::string, Tensor> map_safetensors(const std::string& path);

/// What a file's header says, its data unread: each tensor's dtype as spelled there ("F32",
/// "I64", ...) and shape, and the `__metadata__` strings (Python: SafetensorsFile.dtype, .shape,
/// .metadata).
struct SafetensorsHeader {
  std::map<std::string, std::string> dtypes;
  std::map<std::string, std::vector<int64_t>> shapes;
  std::map<std::string, std::string> metadata;
};
SafetensorsHeader read_safetensors_header(const std::string& path);

/// Every weight of an artifact (Python: dsv4c.runtime.weights.open_weights), memory-mapped from
/// the shards its manifest lists: no data is read until used, storage dtypes as
/// read_safetensors, stacked weights as one tensor. The maps are read-only (PROT_READ): writing
/// to a weight faults. Tensors whose size is a multiple of 64 bytes are 64-byte aligned.
/// With `read`, each tensor is read into storage of its own instead (Tensor::for_reading).
/// Checks the manifest (format version, file sizes), every shard's header and the index against
/// the shards; throws ArtifactError / CheckpointError with the Python loader's messages.
std::map<std::string, Tensor> read_artifact_weights(const std::string& artifact_dir, bool read = false);
/// The same, given the manifest its caller has already read (and checked: read_manifest hashes
/// the small files, so reading it twice would hash them twice).
std::map<std::string, Tensor> read_artifact_weights(const std::string& artifact_dir, const json::Fields& manifest,
                                                    bool read);

/// The weights modes (EngineOptions::weights) and the share of MemAvailable that "auto" reads
/// weight files up to, on the CPU (Python: runtime/weights.py, WEIGHTS_MODES, READ_SHARE).
inline const char* const kWeightsModes[] = {"auto", "read", "map"};
inline constexpr double kReadShare = 0.5;

/// Whether a host on the CPU (`on_host`) or on a GPU reads the weights for a checked `mode`
/// (Python: runtime.weights.reads_weights).
bool reads_weights(const std::string& artifact_dir, const json::Fields& manifest, const std::string& mode,
                   bool on_host);

}  // namespace dsv4c

#endif  // DSV4C_SRC_SAFETENSORS_H_
