#include "step.h"

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/string.h>

#include <dlfcn.h>
#include <limits.h>
#include <malloc.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "artifact.h"
#include "dsv4c/errors.h"
#include "safetensors.h"

namespace dsv4c {
namespace ffi = tvm::ffi;
namespace {

constexpr int kPooledAllocator = 2;  // the VM's memory::AllocatorType::kPooled

ffi::Function global(const char* name) {
  auto f = ffi::Function::GetGlobal(name);
  if (!f) throw std::logic_error(std::string("the TVM runtime lacks ") + name);
  return *f;
}

// Python twin: runtime.tvm_runtime.release_cached_memory.
void release_cached_memory() {
  static const ffi::Function clear_pools = global("vm.builtin.memory_manager.clear");
  clear_pools();
#ifdef __GLIBC__
  malloc_trim(0);
#endif
}

DLDataType dtype_of(const std::string& name) {
  static const std::map<std::string, DLDataType> kTypes = {
      {"float32", {kDLFloat, 32, 1}}, {"int32", {kDLInt, 32, 1}}, {"uint8", {kDLUInt, 8, 1}},
      {"uint16", {kDLUInt, 16, 1}}};
  auto it = kTypes.find(name);
  if (it == kTypes.end()) throw std::logic_error("no pool tensor type " + name);
  return it->second;
}

// A host tensor as a TVM tensor without a copy; the TVM tensor keeps the storage alive.
ffi::Tensor share(const Tensor& t) {
  struct Owner {
    std::shared_ptr<void> data;
    std::vector<int64_t> shape;
  };
  auto* owner = new Owner{t.data, t.shape};
  auto* managed = new DLManagedTensor{
      DLTensor{t.data.get(), DLDevice{kDLCPU, 0}, static_cast<int32_t>(owner->shape.size()), t.dtype,
               owner->shape.data(), nullptr, 0},
      owner, [](DLManagedTensor* self) {
        delete static_cast<Owner*>(self->manager_ctx);
        delete self;
      }};
  return ffi::Tensor::FromDLPack(managed, 64);
}

std::string trimmed(const std::string& s) {
  size_t first = s.find_first_not_of(" \t"), last = s.find_last_not_of(" \t");
  return first == std::string::npos ? "" : s.substr(first, last - first + 1);
}

// Asks Linux to let this process use AMX tiles (its kernels run on them): until a process asks
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), its first tile instruction kills it
// with SIGILL. Covers every thread; asking again is harmless (Python: backend_tvm.request_tile_data).
void request_tile_data(const std::string& path) {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    throw ArtifactError(path + ": its kernels use AMX tiles, and Linux refused this process their state (arch_prctl "
                        "ARCH_REQ_XCOMP_PERM: " + std::strerror(errno) +
                        "; Linux 5.16 and later grant it where AMX is enabled); recompile with --cpu x86-64-v4 "
                        "(AVX-512, no AMX)");
  }
#endif
}

// Refuses an llvm artifact whose code uses instructions this CPU lacks, as Linux lists them in
// /proc/cpuinfo (Python: backend_tvm.check_cpu and targets.host_cpu_flags).
void check_cpu(const std::string& path, const json::Fields& kernels) {
  std::string mcpu = kernels.string("mcpu");
  std::vector<std::string> needs;
  for (const json::Value& f : kernels.array("cpu_features")) {
    if (!json::as_string(f)) kernels.fail("cpu_features", "a list");
    needs.push_back(*json::as_string(f));
  }
  std::map<std::string, std::string> fields;  // the first processor's entry
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line) && !trimmed(line).empty();) {
    size_t colon = line.find(':');
    fields.emplace(trimmed(line.substr(0, colon)), colon == std::string::npos ? "" : trimmed(line.substr(colon + 1)));
  }
  if (!fields.count("flags")) return;  // nothing to check against (not Linux on x86)
  std::set<std::string> flags;
  std::istringstream words(fields["flags"]);
  for (std::string w; words >> w;) flags.insert(w);
  std::string missing;
  for (const std::string& f : needs) {
    if (!flags.count(f)) missing += (missing.empty() ? "" : ", ") + f;
  }
  if (!missing.empty()) {
    std::string model = fields.count("model name") ? fields["model name"] : "unknown model";
    throw ArtifactError(path + ": compiled for CPU " + mcpu + ", which needs " + missing + " that this CPU (" + model +
                        ") lacks; recompile with --cpu native (this CPU) or --cpu x86-64-v3 (any AVX2 CPU)");
  }
  if (std::find(needs.begin(), needs.end(), "amx_tile") != needs.end()) request_tile_data(path);
}

// Refuses a process that flushes float32 subnormals to zero (DAZ / FTZ): the CPU kernels decode
// FP8 / FP4 codes through them (Python: backend_tvm.check_subnormals).
void check_subnormals(const std::string& path) {
  volatile float tiny = 0x1p-140f;
  if (!(tiny * 2.0f > 0.0f)) {
    throw ArtifactError(path + ": this process flushes float32 subnormals to zero (DAZ / FTZ, set by a library built "
                        "with -ffast-math?); the CPU kernels need them: load the artifact before that library");
  }
}

// Cores this process may run on, hyperthreads of one core counted once (Python:
// backend_tvm.physical_cores).
int physical_cores() {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return 1;
  std::set<std::string> cores;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    std::ifstream siblings("/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/thread_siblings_list");
    std::string list;
    cores.insert(std::getline(siblings, list) ? list : std::to_string(cpu));
  }
  return std::max<int>(1, cores.size());
}

// Runs the CPU kernels on every physical core, unless the user set TVM_NUM_THREADS or
// OMP_NUM_THREADS: TVM sizes its pool from them when the first parallel kernel runs, else from
// half the logical CPUs (Python: backend_tvm.use_physical_cores, which says why).
void use_physical_cores() {
  if (!std::getenv("TVM_NUM_THREADS") && !std::getenv("OMP_NUM_THREADS")) {
    setenv("TVM_NUM_THREADS", std::to_string(physical_cores()).c_str(), 0);
  }
}

// TVM's CUDA runtime (the CUDA device API and the loader of the library's CUDA module) is a
// library of its own beside libtvm_runtime.so, linked against the CUDA driver (libcuda.so.1);
// `import tvm` loads it for Python, and nothing else would here. It registers itself when
// loaded. False where it cannot be: no driver, so no CUDA GPU either.
bool load_cuda_runtime() {
  void* runtime = dlopen("libtvm_runtime.so", RTLD_NOW | RTLD_NOLOAD);
  char dir[PATH_MAX];
  if (runtime == nullptr || dlinfo(runtime, RTLD_DI_ORIGIN, dir) != 0) return false;
  return dlopen((std::string(dir) + "/libtvm_runtime_cuda.so").c_str(), RTLD_NOW | RTLD_LOCAL) != nullptr;
}

// The device an artifact's target runs on (Python: TargetInfo.device, and on the CPU
// backend_tvm.check_cpu and check_subnormals), or an ArtifactError.
DLDevice device_for(const std::string& path, const json::Fields& manifest) {
  const std::string target = manifest.string("target");
  if (target == "llvm") {
    check_cpu(path, manifest.object("kernels"));
    check_subnormals(path);
    use_physical_cores();
    return DLDevice{kDLCPU, 0};
  }
  DLDevice device{target == "sm90" ? kDLCUDA : kDLROCM, 0};
  bool exists = false;
  auto attr = ffi::Function::GetGlobal("runtime.GetDeviceAttr");
  if (attr && (target != "sm90" || load_cuda_runtime())) {
    try {
      exists = (*attr)(static_cast<int>(device.device_type), 0, 0).cast<int64_t>() != 0;  // kExist
    } catch (const ffi::Error&) {  // a TVM runtime built without that device's API
      exists = false;
    }
  }
  if (!exists) {
    throw ArtifactError(path + ": an artifact for " + target + " needs that GPU and this host has none; run it "
                        "there, or compile with --target llvm for this CPU");
  }
  return device;
}

// The VM of the artifact's library: the executable it holds, on `device` (host memory on the CPU).
ffi::Module load_vm(const std::string& artifact, const json::Fields& vm, DLDevice device) {
  ffi::Module library = ffi::Module::LoadFromFile(join_path(artifact, vm.string("library")));
  ffi::Module machine = library->GetFunction("vm_load_executable").value()().cast<ffi::Module>();
  machine->GetFunction("vm_initialization").value()(static_cast<int>(device.device_type), device.device_id,
                                                    kPooledAllocator, static_cast<int>(kDLCPU), 0, kPooledAllocator);
  return machine;
}

// The inputs every entry function takes first (Python: codegen.relax_step.STEP_INPUTS); a V4.1
// step with Engram layers takes its Engram inputs after them.
const char* const kStepInputs[] = {"tokens",     "positions",  "token_request", "requests",
                                   "block_table", "logit_rows", "entry_extents"};

}  // namespace

CompiledStep::CompiledStep(const std::string& artifact, const json::Fields& manifest, const KVPool& pool,
                           const std::string& weights_mode, const std::string& engram_memory,
                           bool gather_engram_rows, double release_every)
    : pool_(pool),
      device_(device_for(artifact, manifest)),
      vm_(load_vm(artifact, manifest.object("vm"), device_)),
      release_every_(release_every) {
  json::Fields vm = manifest.object("vm");
  std::vector<std::string> inputs;
  for (const json::Value& input : vm.array("inputs")) inputs.push_back(json::as_string(input).value_or(""));
  const size_t common = std::size(kStepInputs);
  if (inputs.size() < common || !std::equal(kStepInputs, kStepInputs + common, inputs.begin())) {
    vm.fail("inputs", "the step's input names");
  }
  gathers_engram_rows_ = device_.device_type != kDLCPU || gather_engram_rows;
  bind_engram_inputs(artifact, manifest, std::vector<std::string>(inputs.begin() + common, inputs.end()),
                     engram_memory == "read");
  decode_ = vm_->GetFunction("decode").value();
  prefill_ = vm_->GetFunction("prefill").value();
  decode_max_tokens_ = vm.integer("decode_max_tokens");
  max_step_tokens_ = vm.integer("max_step_tokens");
  entry_ratios_ = vm.integers("entry_ratios");
  context_buckets_ = vm.flag("cuda_graph");
  if (manifest.get("vision")) {  // Python: artifact.vision.read_vision_manifest
    json::Fields vision = manifest.object("vision");
    encode_image_ = vm_->GetFunction(vision.string("function")).value();
    patch_size_ = vision.integer("patch_size");
    max_patches_ = vision.object("tower").integer("max_patches");
  }
  // A V4.1 model that sees images: its prefill function takes the step's image rows and each
  // token's row of them after vm.inputs (Python: codegen.relax_step.IMAGE_INPUTS). This host
  // runs text prompts, so no token takes one: a zero row, and -1 per token.
  if (vm.get("image_inputs")) {
    std::vector<std::string> names;
    for (const json::Value& name : vm.array("image_inputs")) names.push_back(json::as_string(name).value_or(""));
    if (names != std::vector<std::string>{"image_rows", "image_index"}) vm.fail("image_inputs", "the image inputs");
    takes_images_ = true;
  }

  ffi::Function alloc = global("runtime.TVMTensorAllocWithScope");
  ffi::Function copy_in = global("runtime.TVMTensorCopyFromBytes");
  auto empty = [&](const std::vector<int64_t>& shape, DLDataType dtype) {
    return alloc(ffi::Shape(shape), dtype, device_, ffi::Optional<ffi::String>()).cast<ffi::Tensor>();
  };
  // Weights are mapped from their shards or read (see reads_weights), constants read from theirs.
  std::map<std::string, Tensor> weights =
      read_artifact_weights(artifact, manifest,
                            reads_weights(artifact, manifest, weights_mode, device_.device_type == kDLCPU));
  for (auto& [name, t] : read_safetensors(join_path(artifact, vm.string("constants")))) weights.emplace(name, t);
  for (const json::Value& name_value : vm.array("params")) {
    std::string name = json::as_string(name_value).value_or("");
    auto it = weights.find(name);
    if (it == weights.end()) {
      throw CheckpointError(artifact + ": tensor " + json::py_repr(name_value) +
                            " that the step reads is missing; recompile with weights");
    }
    params_.push_back(to_device(it->second));
  }
  // The pool's tensors, zeroed (rings are emptied by the step feeding a request's position 0).
  for (const json::Value& entry : vm.array("pool")) {
    json::Fields desc(json::as_object(entry).value(), manifest.file(), "vm.pool[]");
    std::string rows = desc.string("rows");
    std::vector<int64_t> shape = desc.integers("shape");
    shape.insert(shape.begin(), rows == "main" ? pool.total_rows() : rows == "index" ? pool.index_rows()
                                                                                     : pool.max_slots());
    Tensor zeros = Tensor::zeros(shape, dtype_of(desc.string("dtype")));
    ffi::Tensor t = empty(shape, zeros.dtype);
    copy_in(t, zeros.ptr<void>(), static_cast<int64_t>(zeros.nbytes()));
    pool_tensors_.push_back(t);
  }
  if (takes_images_) {
    const int64_t width = manifest.object("model").integer("hidden_size");
    std::vector<float> zeros(static_cast<size_t>(width), 0.0f);
    no_image_rows_ = empty({1, width}, DLDataType{kDLFloat, 32, 1});
    copy_in(no_image_rows_, static_cast<void*>(zeros.data()), static_cast<int64_t>(zeros.size() * sizeof(float)));
  }
}

// A V4.1 step's Engram inputs: each token's rows, then, where the artifact keeps the tables in
// files of their own (manifest "engram.tables"), each table's rows and an FP8 table's scales.
void CompiledStep::bind_engram_inputs(const std::string& artifact, const json::Fields& manifest,
                                      const std::vector<std::string>& names, bool read) {
  if (names.empty()) return;
  if (names[0] != "engram_rows") {
    throw ArtifactError(artifact + ": its step takes an input " + json::py_repr(ffi::String(names[0])) +
                        " that this C++ host does not know; run it with dsv4c generate or dsv4c serve");
  }
  takes_engram_rows_ = true;
  engram_tables_ = open_engram_tables(artifact, manifest, read);
  std::vector<std::string> want;  // Python: backend_tvm.check_table_inputs
  for (const EngramTable& t : engram_tables_) {
    for (const std::string& name : t.inputs()) want.push_back(name);
  }
  if (std::vector<std::string>(names.begin() + 1, names.end()) != want) {
    throw ArtifactError(artifact + ": the step's inputs after engram_rows are not the Engram tables " +
                        json::py_list(want) + " the manifest lists (an older layout); recompile");
  }
  gathers_engram_rows_ = gathers_engram_rows_ && !engram_tables_.empty();
  for (const EngramTable& t : engram_tables_) {
    if (gathers_engram_rows_) break;  // the tables stay in host memory
    whole_tables_.push_back(to_device(t.rows));
    if (t.scales.data) whole_tables_.push_back(to_device(t.scales));
  }
}

ffi::Tensor CompiledStep::upload(const std::vector<int32_t>& values, std::vector<int64_t> shape) const {
  static const ffi::Function alloc = global("runtime.TVMTensorAllocWithScope");
  static const ffi::Function copy_in = global("runtime.TVMTensorCopyFromBytes");
  ffi::Tensor t = alloc(ffi::Shape(shape), kI32, device_, ffi::Optional<ffi::String>()).cast<ffi::Tensor>();
  copy_in(t, static_cast<void*>(const_cast<int32_t*>(values.data())), static_cast<int64_t>(values.size() * sizeof(int32_t)));
  return t;
}

// On the CPU an aligned host tensor is shared with the kernels as it is (a mapped one's pages
// load as they are first read); anything else is copied to the device.
ffi::Tensor CompiledStep::to_device(const Tensor& t) const {
  if (device_.device_type == kDLCPU && t.aligned()) return share(t);
  static const ffi::Function alloc = global("runtime.TVMTensorAllocWithScope");
  static const ffi::Function copy_in = global("runtime.TVMTensorCopyFromBytes");
  ffi::Tensor out = alloc(ffi::Shape(t.shape), t.dtype, device_, ffi::Optional<ffi::String>()).cast<ffi::Tensor>();
  copy_in(out, t.ptr<void>(), static_cast<int64_t>(t.nbytes()));
  return out;
}

// The step's Engram inputs in vm.inputs order. Whole tables on the CPU, the hashed ids as they
// are; off it, per table the rows the ids name (EngramTable::compact; `padded` for a decode step
// that replays a CUDA graph) and the ids remapped into them, so only those rows leave host memory
// (Python: TvmBackend._engram_inputs).
std::vector<ffi::Any> CompiledStep::engram_arguments(const EngramRows& engram_rows, bool padded) const {
  const int64_t per_layer = engram_rows.per_layer, per_token = engram_rows.layers * per_layer;
  const int64_t n = per_token ? static_cast<int64_t>(engram_rows.rows.size()) / per_token : 0;
  std::vector<int32_t> ids = engram_rows.rows;
  std::vector<ffi::Any> tables(whole_tables_.begin(), whole_tables_.end());
  for (size_t e = 0; gathers_engram_rows_ && e < engram_tables_.size(); ++e) {
    std::vector<int32_t> layer_ids;  // [T, C]: this table's rows of every token
    for (int64_t t = 0; t < n; ++t) {
      const auto first = ids.begin() + t * per_token + static_cast<int64_t>(e) * per_layer;
      layer_ids.insert(layer_ids.end(), first, first + per_layer);
    }
    EngramTable compact = engram_tables_[e].compact(layer_ids, padded);
    for (int64_t t = 0; t < n; ++t) {
      std::copy_n(layer_ids.begin() + t * per_layer, per_layer, ids.begin() + t * per_token + e * per_layer);
    }
    tables.push_back(to_device(compact.rows));
    if (compact.scales.data) tables.push_back(to_device(compact.scales));
  }
  tables.insert(tables.begin(), upload(ids, {n, engram_rows.layers, per_layer}));
  return tables;
}

std::vector<float> CompiledStep::run(const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions,
                                     const std::vector<int32_t>& seq_ids, const std::vector<int32_t>& logit_rows,
                                     const EngramRows& engram_rows) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n > max_step_tokens_) {
    throw UsageError("a step of " + std::to_string(n) + " tokens exceeds the artifact's max_step_tokens (" +
                     std::to_string(max_step_tokens_) + ")");
  }
  // The step's compact inputs (Python: backend_tvm.step_inputs): requests in order of first
  // appearance, per request (slot, first token, token count, first position) and its blocks.
  std::vector<int32_t> token_request(n), requests;
  std::vector<const std::vector<int64_t>*> tables;
  std::map<int32_t, int32_t> index_of;
  for (int64_t t = 0; t < n; ++t) {
    auto [it, fresh] = index_of.emplace(seq_ids[t], static_cast<int32_t>(tables.size()));
    if (fresh) {
      const RequestRows& rows = pool_.request(seq_ids[t]);
      requests.insert(requests.end(), {static_cast<int32_t>(rows.slot), static_cast<int32_t>(t), 0, positions[t]});
      tables.push_back(&rows.blocks);
    } else if (seq_ids[t - 1] != seq_ids[t]) {
      throw UsageError("request " + std::to_string(seq_ids[t]) + ": its tokens must be contiguous in the step");
    }
    token_request[t] = it->second;
    requests[4 * it->second + 2] += 1;
  }
  int64_t last = n ? *std::max_element(positions.begin(), positions.end()) + 1 : 1;
  size_t width = 1;
  if (context_buckets_ && n <= decode_max_tokens_) {  // Python: artifact.pool.context_bucket
    int64_t bucket = kEnvelopeTokens;
    while (bucket < last) bucket <<= 1;
    last = bucket;
    width = static_cast<size_t>(bucket / kEnvelopeTokens);
  }
  for (const auto* table : tables) width = std::max(width, table->size());
  std::vector<int32_t> block_table(tables.size() * width, 0);
  for (size_t i = 0; i < tables.size(); ++i) std::copy(tables[i]->begin(), tables[i]->end(), block_table.begin() + i * width);
  std::vector<int64_t> extents;
  for (int64_t ratio : entry_ratios_) extents.push_back(std::max<int64_t>(1, last / ratio));

  const int64_t r = static_cast<int64_t>(tables.size());
  // A step that needs no logits (a prefill chunk) still computes one row: no empty tensors.
  const std::vector<int32_t> rows = logit_rows.empty() ? std::vector<int32_t>{static_cast<int32_t>(n - 1)} : logit_rows;
  ffi::Function& fn = n <= decode_max_tokens_ ? decode_ : prefill_;
  std::vector<ffi::Any> arguments = {
      upload(tokens, {n}), upload(positions, {n}), upload(token_request, {n}), upload(requests, {r, 4}),
      upload(block_table, {r, static_cast<int64_t>(width)}), upload(rows, {static_cast<int64_t>(rows.size())}),
      ffi::Shape(extents)};
  if (takes_engram_rows_) {
    const bool padded = context_buckets_ && n <= decode_max_tokens_;
    for (ffi::Any& input : engram_arguments(engram_rows, padded)) arguments.push_back(std::move(input));
  }
  if (takes_images_ && n > decode_max_tokens_) {
    arguments.push_back(no_image_rows_);
    arguments.push_back(upload(std::vector<int32_t>(static_cast<size_t>(n), -1), {n}));
  }
  arguments.push_back(params_);
  arguments.push_back(pool_tensors_);
  const auto now = std::chrono::steady_clock::now();
  if (device_.device_type == kDLCPU &&
      std::chrono::duration<double>(now - released_at_).count() >= release_every_) {
    release_cached_memory();
    released_at_ = now;
  }
  const std::vector<ffi::AnyView> views(arguments.begin(), arguments.end());
  ffi::Any result;
  fn.CallPacked(views.data(), static_cast<int32_t>(views.size()), &result);
  // The step returns (logits, the last layer's streams); the host has no MTP layer to feed them to.
  ffi::Tensor logits = result.cast<ffi::Array<ffi::Any>>()[0].cast<ffi::Tensor>();
  std::vector<float> out(static_cast<size_t>(logits.numel()));
  static const ffi::Function copy_out = global("runtime.TVMTensorCopyToBytes");
  copy_out(logits, static_cast<void*>(out.data()), static_cast<int64_t>(out.size() * sizeof(float)));
  out.resize(logit_rows.size() * (out.size() / rows.size()));
  return out;
}

ImageRows CompiledStep::encode_image(const std::vector<float>& pixels, int64_t height, int64_t width) const {
  if (!encode_image_) {
    throw UsageError("this artifact has no vision tower (its model has no vision_config, or its target runs none); "
                     "images need one");
  }
  // Python: VisionGeometry.check_pixels, the same words.
  const std::string shape = "(3, " + std::to_string(height) + ", " + std::to_string(width) + ")";
  const int64_t p = patch_size_;
  if (height < p || width < p || height % p || width % p) {
    throw UsageError("pixels of shape " + shape + ": encode_image takes float32 [3, H, W] with H and W positive "
                     "multiples of the patch size " + std::to_string(p));
  }
  if (static_cast<int64_t>(pixels.size()) != 3 * height * width) {
    throw UsageError("pixels of shape " + shape + " hold " + std::to_string(3 * height * width) + " values, not " +
                     std::to_string(pixels.size()));
  }
  const int64_t patches = (height / p) * (width / p);
  if (patches > max_patches_) {
    throw UsageError("pixels of shape " + shape + " are " + std::to_string(patches) + " patches; this artifact's "
                     "encode_image takes at most " + std::to_string(max_patches_));
  }
  Tensor host = Tensor::zeros({3, height, width});
  std::copy(pixels.begin(), pixels.end(), host.ptr<float>());
  std::vector<ffi::Any> arguments = {to_device(host), params_};
  const std::vector<ffi::AnyView> views(arguments.begin(), arguments.end());
  ffi::Any result;
  encode_image_->CallPacked(views.data(), static_cast<int32_t>(views.size()), &result);
  ffi::Tensor rows = result.cast<ffi::Tensor>();
  ImageRows out{std::vector<float>(static_cast<size_t>(rows.numel())), rows.size(0), rows.size(1)};
  static const ffi::Function copy_out = global("runtime.TVMTensorCopyToBytes");
  copy_out(rows, static_cast<void*>(out.rows.data()), static_cast<int64_t>(out.rows.size() * sizeof(float)));
  return out;
}

}  // namespace dsv4c
