// pybind11 surface of the native CPU module `syncd._native`. Buffers come in through the buffer protocol
// (NumPy views of torch tensors); no libtorch. Every entry point releases the GIL while it works.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "v2_kernels.h"
#include "changed_words.h"
#include "changes_pool.h"
#include "checksum.h"
#include "delta_codec.h"
#include "scatter.h"

namespace py = pybind11;
using namespace syncd;

namespace syncd {
void register_nvfp4(py::module_& m);  // nvfp4_bindings.cpp
void register_replay(py::module_& m);  // replay_bindings.cpp
}

namespace {

struct View {
  const uint8_t* ptr;
  size_t size;
};

View read_view(const py::buffer& b, py::buffer_info& keep, bool writable = false) {
  keep = b.request(writable);
  if (keep.ndim > 1) {
    ssize_t expect = keep.itemsize;
    for (ssize_t i = keep.ndim - 1; i >= 0; --i) {
      if (keep.strides[i] != expect) throw std::invalid_argument("buffer must be C-contiguous");
      expect *= keep.shape[i];
    }
  } else if (keep.ndim == 1 && keep.shape[0] > 1 && keep.strides[0] != keep.itemsize) {
    throw std::invalid_argument("buffer must be contiguous");
  }
  return {static_cast<const uint8_t*>(keep.ptr), size_t(keep.size) * size_t(keep.itemsize)};
}

std::vector<uint64_t> to_shape(const std::vector<int64_t>& s) {
  std::vector<uint64_t> r;
  for (int64_t d : s) {
    if (d < 0) throw DeltaError("negative dimension in shape");
    r.push_back(uint64_t(d));
  }
  return r;
}

size_t itemsize_of(int dtype_code) { return size_t(dtype_info(dtype_code).bits / 8); }

void check_size(size_t have, const std::vector<uint64_t>& shape, int dtype_code, const char* what) {
  unsigned __int128 n = itemsize_of(dtype_code);
  for (uint64_t d : shape) n *= d;
  if (n != have) throw std::invalid_argument(std::string(what) + " has " + std::to_string(have) + " bytes, shape and dtype need " + std::to_string(uint64_t(n)));
}

py::bytes to_bytes(const std::vector<uint8_t>& v) { return py::bytes(reinterpret_cast<const char*>(v.data()), v.size()); }

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "syncd native CPU kernels: delta codec (formats 1 and 2) and content checksum";
  py::register_exception<DeltaError>(m, "NativeDeltaError", PyExc_ValueError);

  m.attr("FORMAT_VERSIONS") = py::make_tuple(1, 2);
  m.attr("DEFAULT_FORMAT") = kDefaultFormat;
  m.attr("CODEC_SIMD") = simd_name(simd_level());
  m.attr("PROB_BITS") = kProbBits;
  m.attr("RANS_L") = kRansL;
  m.attr("DEFAULT_BLOCK_LOG2") = kDefaultBlockLog2;

  m.def("checksum", [](const py::buffer& b, int threads) {
    py::buffer_info keep;
    View v = read_view(b, keep);
    py::gil_scoped_release nogil;
    return checksum(v.ptr, v.size, threads);
  }, py::arg("data"), py::arg("threads") = 1, "64-bit content checksum of a contiguous buffer's bytes.");

  m.def("encode", [](const py::buffer& old_b, const py::buffer& new_b, int dtype_code, const std::vector<int64_t>& shape,
                     int block_log2, int threads, int version) {
    py::buffer_info k1, k2;
    View o = read_view(old_b, k1), n = read_view(new_b, k2);
    auto sh = to_shape(shape);
    check_size(o.size, sh, dtype_code, "old");
    check_size(n.size, sh, dtype_code, "new");
    std::vector<uint8_t> out;
    {
      py::gil_scoped_release nogil;
      out = delta_encode(o.ptr, n.ptr, dtype_code, sh, block_log2, threads, version);
    }
    return to_bytes(out);
  }, py::arg("old"), py::arg("new"), py::arg("dtype_code"), py::arg("shape"), py::arg("block_log2") = kDefaultBlockLog2,
     py::arg("threads") = 1, py::arg("version") = kDefaultFormat);

  m.def("apply", [](const py::buffer& target, const py::buffer& blob, int dtype_code, const std::vector<int64_t>& shape,
                    bool verify, int threads) {
    py::buffer_info kt, kb;
    View t = read_view(target, kt, /*writable=*/true);
    View bl = read_view(blob, kb);
    auto sh = to_shape(shape);
    check_size(t.size, sh, dtype_code, "target");
    py::gil_scoped_release nogil;
    delta_apply(const_cast<uint8_t*>(t.ptr), bl.ptr, bl.size, dtype_code, sh, verify, threads);
  }, py::arg("target"), py::arg("blob"), py::arg("dtype_code"), py::arg("shape"), py::arg("verify") = true,
     py::arg("threads") = 1);

  // Pointer entry points: the caller (syncd.ops) passes data_ptr() of contiguous CPU tensors it keeps alive
  // for the call, skipping the buffer-protocol round trip (microseconds per call, over hundreds of tensors).
  m.def("checksum_ptr", [](uintptr_t ptr, size_t nbytes, int threads) {
    py::gil_scoped_release nogil;
    return checksum(reinterpret_cast<const uint8_t*>(ptr), nbytes, threads);
  }, py::arg("ptr"), py::arg("nbytes"), py::arg("threads") = 1);

  m.def("checksum_strided_ptr", [](uintptr_t ptr, size_t numel, size_t itemsize, size_t stride_bytes, int threads) {
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8)
      throw std::invalid_argument("checksum_strided_ptr: itemsize must be 1, 2, 4 or 8");
    py::gil_scoped_release nogil;
    return checksum_strided(reinterpret_cast<const uint8_t*>(ptr), numel, itemsize, stride_bytes, threads);
  }, py::arg("ptr"), py::arg("numel"), py::arg("itemsize"), py::arg("stride_bytes"), py::arg("threads") = 1,
     "checksum of an element-strided view (element i at ptr + i * stride_bytes), as of its contiguous copy.");

  m.def("checksum_many_ptr", [](const std::vector<std::pair<uintptr_t, size_t>>& bufs, int threads) {
    std::vector<std::pair<const uint8_t*, size_t>> b;
    for (const auto& [ptr, n] : bufs) b.emplace_back(reinterpret_cast<const uint8_t*>(ptr), n);
    py::gil_scoped_release nogil;
    return checksum_many(b, threads);
  }, py::arg("buffers"), py::arg("threads") = 1, "checksum of every (data_ptr, nbytes), all in one pool.");
  m.def("encode_ptr", [](uintptr_t old_ptr, uintptr_t new_ptr, int dtype_code, const std::vector<int64_t>& shape,
                         int block_log2, int threads, int version) {
    auto sh = to_shape(shape);
    std::vector<uint8_t> out;
    {
      py::gil_scoped_release nogil;
      out = delta_encode(reinterpret_cast<const uint8_t*>(old_ptr), reinterpret_cast<const uint8_t*>(new_ptr),
                         dtype_code, sh, block_log2, threads, version);
    }
    return to_bytes(out);
  }, py::arg("old_ptr"), py::arg("new_ptr"), py::arg("dtype_code"), py::arg("shape"),
     py::arg("block_log2") = kDefaultBlockLog2, py::arg("threads") = 1, py::arg("version") = kDefaultFormat);

  m.def("apply_ptr", [](uintptr_t target_ptr, const py::buffer& blob, int dtype_code, const std::vector<int64_t>& shape,
                        bool verify, int threads) {
    py::buffer_info kb;
    View bl = read_view(blob, kb);
    auto sh = to_shape(shape);
    py::gil_scoped_release nogil;
    delta_apply(reinterpret_cast<uint8_t*>(target_ptr), bl.ptr, bl.size, dtype_code, sh, verify, threads);
  }, py::arg("target_ptr"), py::arg("blob"), py::arg("dtype_code"), py::arg("shape"), py::arg("verify") = true,
     py::arg("threads") = 1);

  // Batches: (old_ptr, new_ptr, dtype_code, shape) per tensor -> list of blobs; (target_ptr, blob, dtype_code,
  // shape) per tensor -> list of error messages ("" when applied; a failed target is left unchanged).
  m.def("encode_many_ptr", [](const std::vector<std::tuple<uintptr_t, uintptr_t, int, std::vector<int64_t>>>& items,
                              int block_log2, int threads, int version) {
    std::vector<EncodeJob> jobs;
    for (const auto& [o, n, code, shape] : items)
      jobs.push_back({reinterpret_cast<const uint8_t*>(o), reinterpret_cast<const uint8_t*>(n), code, to_shape(shape)});
    std::vector<std::vector<uint8_t>> blobs;
    {
      py::gil_scoped_release nogil;
      blobs = delta_encode_many(jobs, block_log2, threads, version);
    }
    py::list out;
    for (const auto& b : blobs) out.append(to_bytes(b));
    return out;
  }, py::arg("items"), py::arg("block_log2") = kDefaultBlockLog2, py::arg("threads") = 1,
     py::arg("version") = kDefaultFormat);
  m.def("apply_many_ptr", [](const std::vector<std::tuple<uintptr_t, py::buffer, int, std::vector<int64_t>>>& items,
                             bool verify, int threads) {
    std::vector<ApplyJob> jobs;
    std::vector<py::buffer_info> keep(items.size());  // the blobs stay alive and readable without the GIL
    for (size_t i = 0; i < items.size(); ++i) {
      const auto& [t, blob, code, shape] = items[i];
      View bl = read_view(blob, keep[i]);
      jobs.push_back({reinterpret_cast<uint8_t*>(t), bl.ptr, bl.size, code, to_shape(shape)});
    }
    py::gil_scoped_release nogil;
    return delta_apply_many(jobs, verify, threads);
  }, py::arg("items"), py::arg("verify") = true, py::arg("threads") = 1);
  m.def("changes_pool_bytes", &changes_pool_bytes,
        "Bytes of decoded-change buffers kept for reuse by format-2 applies (at most changes_pool_keep_bytes).");
  m.attr("changes_pool_keep_bytes") = py::int_(kChangesPoolKeepBytes);
  // Engine weight writes: runs of (target_ptr, target_words, stride_bytes, idx_ptr, before_ptr, after_ptr, n,
  // width) ->
  // (failed_run, mismatches); failed_run -1 means every word was written (see scatter.h).
  m.def("scatter_runs_ptr", [](const std::vector<std::tuple<uintptr_t, uint64_t, uint64_t, uintptr_t, uintptr_t,
                                                            uintptr_t, uint64_t, int>>& runs,
                               bool verify, int threads) {
    std::vector<ScatterRun> rs;
    rs.reserve(runs.size());
    for (const auto& [t, numel, stride, idx, before, after, n, width] : runs)
      rs.push_back({reinterpret_cast<uint8_t*>(t), numel, stride, reinterpret_cast<const int64_t*>(idx),
                    reinterpret_cast<const uint8_t*>(before), reinterpret_cast<const uint8_t*>(after), n, width});
    ScatterResult res;
    {
      py::gil_scoped_release nogil;
      res = scatter_runs(rs, verify, threads);
    }
    return py::make_tuple(res.failed_run, res.mismatches);
  }, py::arg("runs"), py::arg("verify") = true, py::arg("threads") = 1);
  // An engine's staging of a tensor it holds whole: (dtype_code, words, old_words, pos, v) -> (old elements,
  // new elements, the checksum raw sum's change); see changed_words.h. Elements come back as unsigned ints
  // of the dtype's width.
  m.def("changed_words", [](int dtype_code, py::array_t<uint64_t, py::array::c_style | py::array::forcecast> words,
                            py::array_t<uint64_t, py::array::c_style | py::array::forcecast> old_words,
                            py::array_t<uint64_t, py::array::c_style | py::array::forcecast> pos,
                            py::array_t<uint64_t, py::array::c_style | py::array::forcecast> v) {
    if (words.size() != old_words.size()) throw std::invalid_argument("words and old_words differ in length");
    if (pos.size() != v.size()) throw std::invalid_argument("pos and v differ in length");
    const DTypeInfo dt = dtype_info(dtype_code);
    const char* fmt = dt.bits == 8 ? "B" : dt.bits == 16 ? "H" : dt.bits == 32 ? "I" : "Q";
    const auto n = py::ssize_t(pos.size());
    py::array old_el(py::dtype(fmt), std::vector<py::ssize_t>{n}), new_el(py::dtype(fmt), std::vector<py::ssize_t>{n});
    uint64_t adj;
    {
      py::gil_scoped_release nogil;
      adj = changed_words(dtype_code, words.data(), old_words.data(), size_t(words.size()), pos.data(), v.data(),
                          size_t(n), static_cast<uint8_t*>(old_el.mutable_data()),
                          static_cast<uint8_t*>(new_el.mutable_data()));
    }
    return py::make_tuple(old_el, new_el, adj);
  }, py::arg("dtype_code"), py::arg("words"), py::arg("old_words"), py::arg("pos"), py::arg("v"));
  m.def("words_at_ptr", [](uintptr_t ptr, size_t numel, size_t itemsize, size_t stride_bytes,
                           py::array_t<uint64_t, py::array::c_style | py::array::forcecast> words, int threads) {
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8)
      throw std::invalid_argument("words_at_ptr: itemsize must be 1, 2, 4 or 8");
    py::array_t<uint64_t> out(words.size());
    {
      py::gil_scoped_release nogil;
      gather_words(reinterpret_cast<const uint8_t*>(ptr), numel, itemsize, stride_bytes, words.data(),
                   size_t(words.size()), out.mutable_data(), threads);
    }
    return out;
  }, py::arg("ptr"), py::arg("numel"), py::arg("itemsize"), py::arg("stride_bytes"), py::arg("words"),
     py::arg("threads") = 1,
     "The 64-bit words `words` of a (strided) view's contiguous byte image, zero past its end; see changed_words.h.");
  // Format 2 needs the classes of the old elements (two per byte, `nibbles`) and each block's e_top.
  m.def("pack", [](int dtype_code, const std::vector<int64_t>& shape, int block_log2,
                   py::array_t<uint64_t, py::array::c_style | py::array::forcecast> pos,
                   py::array_t<uint64_t, py::array::c_style | py::array::forcecast> v,
                   uint64_t base_checksum, uint64_t new_checksum, int threads, int version, py::object nibbles,
                   std::vector<int> e_tops) {
    if (pos.size() != v.size()) throw std::invalid_argument("pos and v differ in length");
    auto sh = to_shape(shape);
    Context ctx;
    py::buffer_info kn;
    if (!nibbles.is_none()) {
      View nv = read_view(nibbles.cast<py::buffer>(), kn);
      ctx.nibbles = nv.ptr;
      unsigned __int128 numel = 1;
      for (uint64_t d : sh) numel *= d;
      if (numel > kMaxNumel || nv.size != (size_t(numel) + 1) / 2)
        throw std::invalid_argument("nibbles must hold ceil(numel / 2) bytes");
      ctx.numel = uint64_t(numel);
      ctx.e_tops = std::move(e_tops);
    }
    std::vector<uint8_t> out;
    {
      py::gil_scoped_release nogil;
      out = delta_pack(dtype_code, sh, block_log2, pos.data(), v.data(), size_t(pos.size()), base_checksum,
                       new_checksum, threads, version, ctx);
    }
    return to_bytes(out);
  }, py::arg("dtype_code"), py::arg("shape"), py::arg("block_log2"), py::arg("pos"), py::arg("v"),
     py::arg("base_checksum"), py::arg("new_checksum"), py::arg("threads") = 1, py::arg("version") = kDefaultFormat,
     py::arg("nibbles") = py::none(), py::arg("e_tops") = std::vector<int>());

  // Format 2's context blocks need the base: its bytes (`base_ptr`, a contiguous CPU tensor the caller keeps
  // alive) or the classes of its elements for the blob's e_tops (`nibbles`, two per byte).
  m.def("unpack", [](const py::buffer& blob, int dtype_code, const std::vector<int64_t>& shape, int threads,
                     uintptr_t base_ptr, py::object nibbles) {
    py::buffer_info kb, kn;
    View bl = read_view(blob, kb);
    auto sh = to_shape(shape);
    BaseView base;
    base.bytes = reinterpret_cast<const uint8_t*>(base_ptr);
    Header h;
    {
      py::gil_scoped_release nogil;
      h = parse_header(bl.ptr, bl.size);
      check_target(h, dtype_code, sh);
    }
    if (!nibbles.is_none()) {
      View nv = read_view(nibbles.cast<py::buffer>(), kn);
      if (nv.size != (size_t(h.numel) + 1) / 2) throw std::invalid_argument("nibbles must hold ceil(numel / 2) bytes");
      base.nibbles = nv.ptr;
    }
    py::array_t<uint64_t> p_arr(h.n_changed), v_arr(h.n_changed);
    uint64_t* pp = p_arr.mutable_data();
    uint64_t* vp = v_arr.mutable_data();
    {
      py::gil_scoped_release nogil;
      delta_unpack_into(h, bl.ptr, pp, vp, threads, base);
    }
    return py::make_tuple(p_arr, v_arr, h.base_checksum, h.new_checksum);
  }, py::arg("blob"), py::arg("dtype_code"), py::arg("shape"), py::arg("threads") = 1, py::arg("base_ptr") = 0,
     py::arg("nibbles") = py::none(),
     "Validate a blob for a target of dtype/shape and return (positions, values, base_checksum, new_checksum).");
  m.def("block_e_tops", [](const py::buffer& blob) {
    py::buffer_info kb;
    View bl = read_view(blob, kb);
    Header h = parse_header(bl.ptr, bl.size);
    return delta_block_e_tops(h, bl.ptr);
  }, py::arg("blob"), "Each block's e_top (format 2 context blocks; -1 for the others).");

  register_nvfp4(m);
  register_replay(m);
}
