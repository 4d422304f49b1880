// The only pybind11 file: exposes the C++ ring as infinity.aio._uring.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "uring_engine.hpp"

namespace py = pybind11;
using infinity::aio::Counters;
using infinity::aio::Error;
using infinity::aio::Request;
using infinity::aio::Ring;

PYBIND11_MODULE(_uring, m) {
  m.doc() = "io_uring engine of infinity.aio (use infinity.aio.open_engine, not this module)";

  // Error carries an errno: raise OSError(errno, message) so Python picks the subclass
  // (PermissionError for EPERM, ...).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      py::tuple args = py::make_tuple(e.code(), e.what());
      PyErr_SetObject(PyExc_OSError, args.ptr());
    }
  });

  py::class_<Request, std::shared_ptr<Request>>(m, "Request")
      .def("done", &Request::done)
      .def("wait", &Request::wait, py::arg("timeout_s") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def("outcome", [](const Request& r) { return py::make_tuple(r.bytes(), r.error()); });

  py::class_<Ring>(m, "Ring")
      .def(py::init<unsigned, uint32_t>(), py::arg("queue_depth"), py::arg("block_size"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "submit",
          // [Note: request ownership] The request is made here, given to ``owner`` (its
          // ``_handle``) and passed to ``own`` (the engine's set of requests in flight) before
          // the worker can see it, all without running Python bytecode: a signal's handler
          // (Ctrl-C's KeyboardInterrupt) runs only between bytecodes, so it lands either before
          // this call (nothing submitted) or after it (the engine waits for the request before
          // anyone may reuse its buffer). Never between the kernel having it and the engine
          // knowing it.
          [](Ring& self, py::object owner, py::object own, bool write, int fd, uintptr_t address,
             uint64_t nbytes, uint64_t offset, bool direct, int file_slot, bool urgent) {
            auto req = std::make_shared<Request>(write, fd, reinterpret_cast<char*>(address),
                                                 nbytes, offset, direct, file_slot, urgent);
            try {
              py::setattr(owner, "_handle", py::cast(req));
              own(owner);
            } catch (...) {
              self.refuse(req, ECANCELED);  // held by the owner maybe: never leave it pending
              throw;
            }
            py::gil_scoped_release nogil;
            self.submit(req);
          },
          py::arg("owner"), py::arg("own"), py::arg("write"), py::arg("fd"), py::arg("address"),
          py::arg("nbytes"), py::arg("offset"), py::arg("direct"), py::arg("file_slot") = -1,
          py::arg("urgent") = false)
      .def(
          "register_buffer",
          [](Ring& self, uintptr_t address, size_t nbytes) {
            return self.register_buffer(reinterpret_cast<void*>(address), nbytes);
          },
          py::call_guard<py::gil_scoped_release>())
      .def("unregister_buffer", &Ring::unregister_buffer, py::call_guard<py::gil_scoped_release>())
      .def("register_file", &Ring::register_file, py::call_guard<py::gil_scoped_release>())
      .def("unregister_file", &Ring::unregister_file, py::call_guard<py::gil_scoped_release>())
      .def("close", &Ring::close, py::arg("cancel") = false,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("setup_flags", &Ring::setup_flags)
      .def("counters", [](const Ring& self) {
        Counters c = self.counters();
        py::dict d;
        d["requests"] = c.requests;
        d["chunks"] = c.chunks;
        d["sqes"] = c.sqes;
        d["enters"] = c.enters;
        d["fixed"] = c.fixed;
        d["retries"] = c.retries;
        d["short"] = c.short_transfers;
        d["errors"] = c.errors;
        d["bytes_read"] = c.bytes_read;
        d["bytes_written"] = c.bytes_written;
        return d;
      });

  m.def("dio_alignment", &infinity::aio::dio_alignment, py::arg("fd"),
        "(memory, offset) alignment O_DIRECT needs on fd, from statx STATX_DIOALIGN; (0, 0) if unknown");
  m.def("probe", &infinity::aio::probe,
        "Empty string when io_uring works here, else the reason it does not");
}
