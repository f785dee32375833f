// optiml._core.gguf_open and the GGUFFile it returns; python/optiml/gguf.py wraps them.
#include "bindings.h"

#include <Python.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "optiml/gguf.h"

using namespace optiml;

namespace {

// Strings that are not valid UTF-8 come back as bytes rather than failing the whole open.
nb::object py_string(const char* p, size_t n) {
    PyObject* s = PyUnicode_DecodeUTF8(p, (Py_ssize_t)n, nullptr);
    if (!s) {
        PyErr_Clear();
        s = PyBytes_FromStringAndSize(p, (Py_ssize_t)n);
        if (!s) throw nb::python_error();
    }
    return nb::steal(s);
}

template <typename T>
nb::object numpy_copy(const GGUFValue& v) {
    auto a = new_array<T>({(size_t)v.n});
    if (v.n) std::memcpy(a.data(), v.data, (size_t)v.n * sizeof(T));
    return nb::cast(a);
}

nb::object py_value(const GGUFValue& v);

nb::object py_array(const GGUFValue& v) {
    switch (v.elem_type) {
        case GGUF_TYPE_UINT8: return numpy_copy<uint8_t>(v);
        case GGUF_TYPE_INT8: return numpy_copy<int8_t>(v);
        case GGUF_TYPE_UINT16: return numpy_copy<uint16_t>(v);
        case GGUF_TYPE_INT16: return numpy_copy<int16_t>(v);
        case GGUF_TYPE_UINT32: return numpy_copy<uint32_t>(v);
        case GGUF_TYPE_INT32: return numpy_copy<int32_t>(v);
        case GGUF_TYPE_FLOAT32: return numpy_copy<float>(v);
        case GGUF_TYPE_BOOL: return numpy_copy<bool>(v);  // the parser allowed only bytes 0 and 1
        case GGUF_TYPE_UINT64: return numpy_copy<uint64_t>(v);
        case GGUF_TYPE_INT64: return numpy_copy<int64_t>(v);
        case GGUF_TYPE_FLOAT64: return numpy_copy<double>(v);
        case GGUF_TYPE_STRING: {
            nb::list out;
            for (std::string_view s : v.strings) out.append(py_string(s.data(), s.size()));
            return out;
        }
        default: {
            nb::list out;
            for (const GGUFValue& a : v.arrays) out.append(py_value(a));
            return out;
        }
    }
}

nb::object py_value(const GGUFValue& v) {
    switch (v.type) {
        case GGUF_TYPE_UINT8: return nb::int_(v.scalar<uint8_t>());
        case GGUF_TYPE_INT8: return nb::int_(v.scalar<int8_t>());
        case GGUF_TYPE_UINT16: return nb::int_(v.scalar<uint16_t>());
        case GGUF_TYPE_INT16: return nb::int_(v.scalar<int16_t>());
        case GGUF_TYPE_UINT32: return nb::int_(v.scalar<uint32_t>());
        case GGUF_TYPE_INT32: return nb::int_(v.scalar<int32_t>());
        case GGUF_TYPE_UINT64: return nb::int_(v.scalar<uint64_t>());
        case GGUF_TYPE_INT64: return nb::int_(v.scalar<int64_t>());
        case GGUF_TYPE_FLOAT32: return nb::float_(v.scalar<float>());
        case GGUF_TYPE_FLOAT64: return nb::float_(v.scalar<double>());
        case GGUF_TYPE_BOOL: return nb::bool_(v.data[0] != 0);
        case GGUF_TYPE_STRING: return py_string((const char*)v.data, (size_t)v.n);
        default: return py_array(v);
    }
}

// "uint32", "string", "array[float32]", "array[array]".
std::string type_string(const GGUFValue& v) {
    if (v.type != GGUF_TYPE_ARRAY) return gguf_type_name(v.type);
    return std::string("array[") + gguf_type_name(v.elem_type) + "]";
}

std::shared_ptr<GGUFFile> open_file(nb::bytes path) {
    std::string p(path.c_str(), path.size());
    try {
        return GGUFFile::open(p);
    } catch (const std::system_error& e) {
        // Becomes FileNotFoundError, PermissionError, IsADirectoryError... with the path attached.
        nb::object name = nb::steal(PyUnicode_DecodeFSDefaultAndSize(p.data(), (Py_ssize_t)p.size()));
        errno = e.code().value();
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name.ptr());
        throw nb::python_error();
    } catch (const GGUFError& e) {
        // The path in the message may not be UTF-8; the rest of the message is ASCII.
        static nb::handle gguf_error = nb::module_::import_("optiml._core").attr("GGUFError");
        nb::object msg = nb::steal(
            PyUnicode_DecodeUTF8(e.what(), (Py_ssize_t)std::strlen(e.what()), "backslashreplace"));
        PyErr_SetObject(gguf_error.ptr(), msg.ptr());
        throw nb::python_error();
    }
}

// The typed getters engine code uses, reachable from Python so the tests can check them.
nb::object typed_get(const GGUFFile& f, const std::string& kind, const std::string& key) {
    if (kind == "string") return nb::cast(f.get_string(key));
    if (kind == "u32") return nb::cast(f.get_u32(key));
    if (kind == "u64") return nb::cast(f.get_u64(key));
    if (kind == "i32") return nb::cast(f.get_i32(key));
    if (kind == "i64") return nb::cast(f.get_i64(key));
    if (kind == "f32") return nb::cast(f.get_f32(key));
    if (kind == "f64") return nb::cast(f.get_f64(key));
    if (kind == "bool") return nb::cast(f.get_bool(key));
    if (kind == "string_array") {
        nb::list out;
        for (const std::string& s : f.get_string_array(key)) out.append(nb::bytes(s.data(), s.size()));
        return out;
    }
    if (kind == "f32_array") return nb::cast(f.get_f32_array(key));
    if (kind == "i32_array") return nb::cast(f.get_i32_array(key));
    if (kind == "u32_array") return nb::cast(f.get_u32_array(key));
    throw ArgumentError("unknown getter kind '" + kind + "'");
}

}  // namespace

void bind_gguf(nb::module_& m) {
    m.def("gguf_open", &open_file, nb::arg("path"),
          "Maps and parses a GGUF file (path as bytes). Use optiml.gguf.open instead.");

    nb::class_<GGUFFile>(m, "GGUFFile")
        .def_prop_ro("version", &GGUFFile::version)
        .def_prop_ro("alignment", &GGUFFile::alignment)
        .def_prop_ro("data_offset", &GGUFFile::data_offset)
        .def_prop_ro("file_size", &GGUFFile::file_size)
        .def("get", &typed_get, nb::arg("kind"), nb::arg("key"),
             "Calls the C++ getter get_<kind>(key): string, u32, u64, i32, i64, f32, f64, bool, "
             "string_array (as bytes), f32_array, i32_array, u32_array.")
        .def("metadata", [](const GGUFFile& f) {
            nb::dict out;
            for (const GGUFKeyValue& kv : f.metadata())
                out[nb::str(kv.key.data(), kv.key.size())] = py_value(kv.value);
            return out;
        }, "Metadata as a dict in file order.")
        .def("metadata_types", [](const GGUFFile& f) {
            nb::dict out;
            for (const GGUFKeyValue& kv : f.metadata())
                out[nb::str(kv.key.data(), kv.key.size())] = nb::str(type_string(kv.value).c_str());
            return out;
        }, "GGUF value type of each metadata entry, e.g. 'uint32' or 'array[string]'.")
        .def("tensors", [](const GGUFFile& f) {
            nb::list out;
            for (const GGUFTensorInfo& t : f.tensors()) {
                nb::list shape;
                for (uint32_t d = 0; d < t.n_dims; d++) shape.append(t.ne[d]);
                out.append(nb::make_tuple(nb::str(t.name.data(), t.name.size()), t.type,
                                          type_traits(t.type).name, nb::tuple(shape),
                                          t.n_elements(), t.n_bytes, t.file_offset));
            }
            return out;
        }, "(name, type, type_name, shape, n_elements, n_bytes, file_offset) for each tensor.")
        .def("tensor_data", [](const GGUFFile& f, const std::string& name) {
            const GGUFTensorInfo& t = f.tensor(name);
            // The view owns a reference to the mapping, so it outlives close() of the file.
            auto* keep = new std::shared_ptr<const MappedFile>(f.mapping());
            nb::capsule owner(keep, [](void* p) noexcept {
                delete static_cast<std::shared_ptr<const MappedFile>*>(p);
            });
            size_t shape[2] = {(size_t)t.n_rows(), (size_t)row_size(t.type, t.ne[0])};
            return nb::ndarray<nb::numpy, const uint8_t, nb::ndim<2>>(
                (const uint8_t*)f.tensor_data(t), 2, shape, owner);
        }, nb::arg("name"), "Read-only uint8 view (rows, row_bytes) of a tensor's data in the mapping.");
}
