// PLACEHOLDER until the sampling work lands.
#include "bindings.h"

void bind_sampling(nb::module_& m) {}
