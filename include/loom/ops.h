// The functional API: every op Loom defines. `loom::ops::` functions compute (infer meta, allocate, dispatch) and
// record no autograd; the differentiable API built on them is in loom/functional.h.
#pragma once

#include "loom/core/tensor.h"
#include "loom/ops/creation.h"
#include "loom/ops/elementwise.h"
#include "loom/ops/fp8.h"
#include "loom/ops/linalg.h"
#include "loom/ops/nn.h"
#include "loom/ops/reduce.h"
#include "loom/ops/shape.h"
#include "loom/ops/views.h"
