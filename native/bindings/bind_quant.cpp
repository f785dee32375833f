// PLACEHOLDER until the quantization helper lands: quantize()/dequantize() for numpy arrays.
#include "bindings.h"

void bind_quant(nb::module_& m) {}
