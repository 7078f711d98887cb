// weights.safetensors: an 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets}}, then the data. Nothing is ever unpickled.
#ifndef DSV4C_SRC_SAFETENSORS_H_
#define DSV4C_SRC_SAFETENSORS_H_

#include <map>
#include <string>

#include "tensor.h"

namespace dsv4c {

/// Every tensor of the file in its storage dtype (as Python's read_raw: BF16 and FP8 as raw
/// unsigned bits), each in its own aligned buffer. Throws CheckpointError with the messages of
/// dsv4c/frontend/safetensors_io.py.
std::map<std::string, Tensor> read_safetensors(const std::string& path);

}  // namespace dsv4c

#endif  // DSV4C_SRC_SAFETENSORS_H_
