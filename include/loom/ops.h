// The functional API: every op Loom defines. `loom::ops::` functions compute (infer meta, allocate, dispatch) and
// record no autograd; the differentiable API built on them is in loom/functional.h.
#pragma once

#include "loom/core/tensor.h"
#include "loom/ops/creation.h"
