// Reading and writing safetensors files (Hugging Face's weight format), the trainer's weight I/O.
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {str: str} (optional), NAME: {"dtype": D, "shape": [..], "data_offsets": [b, e]}, ...}
// then the data section; offsets are relative to its start. The reader accepts exactly the files the
// reference implementation (huggingface/safetensors) accepts for the dtypes it supports: header at
// most 100,000,000 bytes and inside the file, every tensor's bytes numel * dtype size, and the
// tensors tiling the data section with no gap or overlap. F32, F64, BF16 and F16 are read and
// converted to float (F64 rounds to nearest); any other dtype is refused by name.
// The writer writes F32 in the order given, the header padded with spaces to a multiple of 8 bytes
// (as the reference does, so the data section is 8-byte aligned), to PATH.tmp renamed over PATH, so
// a crash never leaves a half-written file under the final name.
// Every problem with a file is a UserError naming the file (and the tensor, where there is one).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace trainer {

// A tensor read from a file: row-major data, converted to float.
struct Tensor {
    std::vector<int64_t> shape;  // empty for a scalar
    std::vector<float> data;     // product of shape elements

    int64_t numel() const;
};

// Reads every tensor of the safetensors file at `path`, by name. When `metadata` is given it
// receives the "__metadata__" map (cleared first; empty when the file has none).
std::map<std::string, Tensor> read_safetensors(const std::string& path,
                                               std::map<std::string, std::string>* metadata = nullptr);

// Refuses (UserError "<what>: tensor "<name>" holds <value> at element <i>; the weights must be finite") tensors with
// a value that is not finite: weights read in that would make the first loss NaN, blamed on the learning rate.
void require_finite(const std::map<std::string, Tensor>& tensors, const std::string& what);

// A tensor to write: `data` points at the product of `shape` row-major floats (may be null when
// that product is 0). Not owned.
struct TensorRef {
    std::string name;
    std::vector<int64_t> shape;
    const float* data;
};

// Writes `tensors` as F32 (in the order given) and `metadata` (omitted when empty) to `path`.
// Names must be distinct and not "__metadata__" (checked: they come from the trainer, not the user).
// UserError naming the path when it cannot be written.
void write_safetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                       const std::map<std::string, std::string>& metadata);

}  // namespace trainer
