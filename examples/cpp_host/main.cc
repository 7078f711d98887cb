// dsv4c_host: generate greedily with a compiled CPU artifact, no Python involved.
//
//   dsv4c_host ART --token-ids 1,2,3 --max-new-tokens 8 [--stop-token-ids IDS] [--prefill-chunk K]
//              [--logits-out FILE.npy] [--greedy] [--verify] [--weights auto|read|map]
//              [--engram-memory map|read] [--gather-engram-rows] [--release-cached-memory-every SECONDS]
//
// Prints the generated ids space-separated, like `dsv4c generate ART --token-ids ... --greedy`.
// --token-ids may be repeated: each is one request, all run batched together, one output line
// each (in the order given); --logits-out then holds their logit rows one request after another.
// --verify checks every artifact file against its sha256 first, as `dsv4c generate --verify`.
// --weights reads the weights into memory or maps them, as `dsv4c generate --weights`;
// --engram-memory does the same for a DeepSeek-V4.1 model's Engram tables (default: map);
// --gather-engram-rows passes each step only the table rows it reads, as GPU targets do, on the
// CPU too (which otherwise passes the whole tables): a check of that path.
// --release-cached-memory-every gives back the step's cached buffers that often (default 30 s;
// 0: before every step), as EngineOptions::release_cached_memory_every.
//
//   dsv4c_host ART --encode-image PIXELS --image-size H,W [--rows-out FILE.npy]
//
// runs a DeepSeek-V4.1 artifact's vision tower on one image the caller prepared: PIXELS holds
// raw little-endian float32 [3, H, W] (RGB planes, rows top to bottom, normalized as
// (value / 255 - 0.5) / 0.5, H and W multiples of the patch size; docs/cpp_host.md). Prints the
// span's token count; --rows-out saves its rows [tokens, hidden] (Python: TvmBackend.encode_image).
// User errors print `dsv4c: error: <message>` (the Python CLI's line) and exit 2.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dsv4c/runtime.h"

namespace {

const char* const kUsage =
    "usage: dsv4c_host ART --token-ids IDS [--token-ids IDS ...] --max-new-tokens N [--greedy]\n"
    "                  [--stop-token-ids IDS] [--prefill-chunk K] [--logits-out FILE] [--verify]\n"
    "                  [--weights auto|read|map] [--engram-memory map|read] [--gather-engram-rows]\n"
    "                  [--release-cached-memory-every SECONDS]\n"
    "       dsv4c_host ART --encode-image PIXELS --image-size H,W [--rows-out FILE]\n";

// A command-line mistake: printed after the usage, like argparse does.
struct ArgumentError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Arguments {
  std::string artifact;
  std::vector<std::vector<int32_t>> prompts;
  std::optional<int64_t> max_new_tokens;
  std::vector<int32_t> stop_token_ids;
  std::optional<int64_t> prefill_chunk;
  std::string logits_out;
  bool verify = false;
  std::string weights = "auto";
  std::string engram_memory = "map";
  bool gather_engram_rows = false;
  std::optional<double> release_cached_memory_every;
  std::string encode_image;        // raw float32 [3, H, W] pixels
  std::vector<int32_t> image_size;  // H, W
  std::string rows_out;
};

int64_t integer(const std::string& option, const std::string& text) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size()) {
    throw ArgumentError("argument " + option + ": invalid int value: '" + text + "'");
  }
  return value;
}

// A number of seconds, at least 0.
double seconds(const std::string& option, const std::string& text) {
  size_t used = 0;
  double value = -1;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size() || !(value >= 0)) {
    throw ArgumentError("argument " + option + ": expected seconds >= 0, got '" + text + "'");
  }
  return value;
}

// "1, 2,3" -> {1, 2, 3}, as `dsv4c generate` reads --token-ids.
std::vector<int32_t> token_ids(const std::string& option, const std::string& text) {
  std::string compact;
  std::copy_if(text.begin(), text.end(), std::back_inserter(compact), [](char c) { return c != ' '; });
  std::vector<int32_t> ids;
  size_t start = 0;
  while (start <= compact.size()) {
    size_t comma = std::min(compact.find(',', start), compact.size());
    std::string item = compact.substr(start, comma - start);
    if (!item.empty()) {
      try {
        ids.push_back(static_cast<int32_t>(integer(option, item)));
      } catch (const ArgumentError&) {
        throw ArgumentError("argument " + option + ": " + option + " must be comma-separated integers, got '" + text +
                            "'");
      }
    }
    start = comma + 1;
  }
  if (ids.empty()) throw ArgumentError("argument " + option + ": " + option + " is empty");
  return ids;
}

Arguments parse(int argc, char** argv) {
  Arguments a;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw ArgumentError("argument " + arg + ": expected one argument");
      return argv[++i];
    };
    if (arg == "--token-ids") {
      a.prompts.push_back(token_ids(arg, value()));
    } else if (arg == "--max-new-tokens") {
      a.max_new_tokens = integer(arg, value());
    } else if (arg == "--stop-token-ids") {
      a.stop_token_ids = token_ids(arg, value());
    } else if (arg == "--prefill-chunk") {
      a.prefill_chunk = integer(arg, value());
    } else if (arg == "--logits-out") {
      a.logits_out = value();
    } else if (arg == "--weights") {
      a.weights = value();
    } else if (arg == "--engram-memory") {
      a.engram_memory = value();
    } else if (arg == "--gather-engram-rows") {
      a.gather_engram_rows = true;
    } else if (arg == "--release-cached-memory-every") {
      a.release_cached_memory_every = seconds(arg, value());
    } else if (arg == "--encode-image") {
      a.encode_image = value();
    } else if (arg == "--image-size") {
      a.image_size = token_ids(arg, value());
      if (a.image_size.size() != 2) throw ArgumentError("argument --image-size: give H,W");
    } else if (arg == "--rows-out") {
      a.rows_out = value();
    } else if (arg == "--verify") {
      a.verify = true;
    } else if (arg == "--greedy") {
      // The only decoding this host does; accepted for parity with `dsv4c generate`.
    } else if (arg.rfind("--", 0) != 0 && a.artifact.empty()) {
      a.artifact = arg;
    } else {
      throw ArgumentError("unrecognized arguments: " + arg);
    }
  }
  if (!a.encode_image.empty()) {
    if (a.artifact.empty() || a.image_size.empty()) {
      throw ArgumentError("the following arguments are required: ART, --image-size");
    }
    return a;
  }
  if (a.artifact.empty() || a.prompts.empty() || !a.max_new_tokens) {
    throw ArgumentError("the following arguments are required: ART, --token-ids, --max-new-tokens");
  }
  return a;
}

// float32 [rows, cols] as a version 1.0 .npy file (little-endian hosts).
void write_npy(const std::string& path, const std::vector<float>& values, int64_t rows, int64_t cols) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) + ", " +
                       std::to_string(cols) + "), }";
  header.append(63 - (10 + header.size()) % 64, ' ');  // magic + version + length + header + '\n' is 64-aligned
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  out.write("\x93NUMPY\x01\x00", 8);
  const char length[2] = {static_cast<char>(header.size() & 0xff), static_cast<char>(header.size() >> 8)};
  out.write(length, 2);
  out << header;
  out.write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(float)));
  if (!out) throw std::runtime_error(path + ": cannot write the array");
}

// The pixels file of --encode-image: raw float32 values.
std::vector<float> read_floats(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw dsv4c::UsageError(path + ": cannot read the pixels");
  std::vector<float> values(static_cast<size_t>(in.tellg()) / sizeof(float));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(float)));
  return values;
}

}  // namespace

int main(int argc, char** argv) {
  Arguments args;
  try {
    args = parse(argc, argv);
  } catch (const ArgumentError& e) {
    std::cerr << kUsage << "dsv4c_host: error: " << e.what() << "\n";
    return 2;
  }
  try {
    dsv4c::EngineOptions options;
    // The same pool as `dsv4c generate` sizes, so that rows land where the Python runtime puts them.
    options.max_context = std::max<int64_t>(4096, args.max_new_tokens.value_or(0) + 8192);
    options.prefill_chunk = args.prefill_chunk;
    options.weights = args.weights;
    options.engram_memory = args.engram_memory;
    options.gather_engram_rows = args.gather_engram_rows;
    if (args.release_cached_memory_every) options.release_cached_memory_every = *args.release_cached_memory_every;
    if (args.verify) dsv4c::verify_artifact(args.artifact);
    dsv4c::Engine engine(args.artifact, options);
    if (!args.encode_image.empty()) {
      dsv4c::ImageRows image = engine.encode_image(read_floats(args.encode_image), args.image_size[0],
                                                   args.image_size[1]);
      std::cout << image.tokens << "\n";
      if (!args.rows_out.empty()) write_npy(args.rows_out, image.rows, image.tokens, image.width);
      return 0;
    }
    dsv4c::GenerationParams params;
    params.max_new_tokens = *args.max_new_tokens;
    params.stop_token_ids = args.stop_token_ids;
    params.record_logits = !args.logits_out.empty();
    std::vector<int64_t> ids;
    for (const std::vector<int32_t>& prompt : args.prompts) ids.push_back(engine.submit(prompt, params));
    engine.run();
    std::vector<float> logits;
    int64_t rows = 0;
    for (int64_t id : ids) {
      dsv4c::Result r = engine.result(id);
      for (size_t i = 0; i < r.tokens.size(); ++i) std::cout << (i ? " " : "") << r.tokens[i];
      std::cout << "\n";
      logits.insert(logits.end(), r.logits.begin(), r.logits.end());
      rows += r.rows;
    }
    if (!args.logits_out.empty()) write_npy(args.logits_out, logits, rows, engine.vocab_size());
  } catch (const dsv4c::Error& e) {
    std::cerr << "dsv4c: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "dsv4c_host: internal error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
