// TokenKind, Segment, TokenLayout: the prompt of a request as runs of text
// and visual tokens.
#include <string>
#include <vector>

#include <pybind11/native_enum.h>
#include <pybind11/operators.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "mixkv/core/token_layout.h"

namespace mixkv::python {

void bind_token_layout(py::module_& m) {
  py::native_enum<TokenKind>(m, "TokenKind", "enum.IntEnum", "Kind of a run of prompt tokens.")
      .value("Text", TokenKind::Text)
      .value("Visual", TokenKind::Visual, "cut into windows of block_size tokens (WindowQuant)")
      .finalize();

  py::class_<Segment>(m, "Segment", init_only(), "A run of `length` tokens of one kind.")
      .def(py::init([](TokenKind kind, std::int32_t length) {
             return Segment{kind, length};
           }),
           py::arg("kind"), py::arg("length"))
      .def_readwrite("kind", &Segment::kind)
      .def_readwrite("length", &Segment::length)
      .def(py::self == py::self)
      .def("__repr__", [](const Segment& s) {
        return std::string("Segment(") + (s.kind == TokenKind::Text ? "TokenKind.Text" : "TokenKind.Visual") + ", " +
               std::to_string(s.length) + ")";
      });

  py::class_<TokenLayout>(m, "TokenLayout", init_only(),
                          "The prompt of one request as ordered runs of text and visual tokens. Each visual segment "
                          "is cut into windows from its own start; a visual tail shorter than a window stays FP16.")
      .def(py::init<std::vector<Segment>>(), py::arg("segments"),
           "Raises ValueError for an empty list, a length < 1 or a total over 2**30 tokens.")
      .def_property_readonly(
          "segments",
          [](const TokenLayout& l) { return std::vector<Segment>(l.segments().begin(), l.segments().end()); })
      .def_property_readonly("num_tokens", &TokenLayout::num_tokens)
      .def("num_windows", &TokenLayout::num_windows, py::arg("window_size"), "Full visual windows, in prompt order.")
      .def("window_starts", &TokenLayout::window_starts, py::arg("window_size"),
           "Prompt index of each window's first token.")
      .def(py::self == py::self)
      .def("__repr__", [](const TokenLayout& l) {
        std::string s = "TokenLayout([";
        for (std::size_t i = 0; i < l.segments().size(); ++i) {
          if (i > 0) s += ", ";
          s += py::repr(py::cast(l.segments()[i]));
        }
        return s + "])";
      });
}

}  // namespace mixkv::python
