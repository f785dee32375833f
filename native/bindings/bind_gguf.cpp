// PLACEHOLDER until the GGUF helper lands.
#include "bindings.h"

void bind_gguf(nb::module_& m) {}
