// What ggml-metal's supports_op and its buffers' get_alloc_size need, without Metal: ggml's own
// headers, ggml-metal's C headers, and the device object reduced to the one member supports_op
// reads (`props`). The props are filled by tests/opcheck/harness.c for the Apple GPU families it
// asks about.
#pragma once

#include "ggml.h"
#include "ggml-impl.h"
#include "ggml-backend-impl.h"
#include "ggml-metal-device.h"
#include "ggml-metal-impl.h"
#include "ggml-metal-common.h"
#include "ggml-metal-ops.h"

// ggml-metal.cpp is C++, where the struct's name is a type
typedef struct ggml_tensor ggml_tensor;

struct ggml_metal_device {
    struct ggml_metal_device_props props;
};
