// PLACEHOLDER until the tokenizer work lands.
#include "bindings.h"

void bind_tokenizer(nb::module_& m) {}
