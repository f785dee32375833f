// PLACEHOLDER until the model work lands.
#include "bindings.h"

void bind_model(nb::module_& m) {}
