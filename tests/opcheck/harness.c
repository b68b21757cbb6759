// ggml-metal's own supports_op and its buffers' get_alloc_size (cut out of the vendored
// ggml-metal sources by tests/backend_ops.py into metal_supports_op.inc), built with the host's C
// compiler, and an eval callback that asks them about every node of a graph llama.cpp computes on
// the CPU.
//
// The callback answers "not needed" for every node (so the graph runs uninterrupted) and records
// one line per node: its name, op, types, shapes, layout facts and op parameters, the bytes a
// Metal buffer allocates for it, and what supports_op says for each Apple GPU profile below.
// tests/backend_ops.py reads the lines back.

#include "metal_stubs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The scratch memory ggml-metal adds to MUL_MAT_ID and FLASH_ATTN_EXT nodes (ggml-metal-ops.cpp,
// C++ over its kernels' tiling) is not counted here: tens of MiB at dg's shapes, inside what dg
// info reserves for the runtime. What these stubs stand for in get_alloc_size is 0.
size_t ggml_metal_op_mul_mat_id_extra_tpe(const struct ggml_tensor * op) { (void) op; return 0; }
size_t ggml_metal_op_mul_mat_id_extra_ids(const struct ggml_tensor * op) { (void) op; return 0; }
size_t ggml_metal_op_mul_mat_id_extra_amax(const struct ggml_tensor * op) { (void) op; return 0; }
size_t ggml_metal_op_flash_attn_ext_extra_pad(const struct ggml_tensor * op) { (void) op; return 0; }
size_t ggml_metal_op_flash_attn_ext_extra_blk(const struct ggml_tensor * op) { (void) op; return 0; }
size_t ggml_metal_op_flash_attn_ext_extra_tmp(const struct ggml_tensor * op) { (void) op; return 0; }
size_t ggml_metal_op_flash_attn_ext_extra_kv_f16(const struct ggml_tensor * op) { (void) op; return 0; }
size_t ggml_metal_op_flash_attn_ext_extra_idx(const struct ggml_tensor * op) { (void) op; return 0; }

#include "metal_supports_op.inc"

// The Apple GPU families asked about. Apple7 (M1) is the oldest GPU on which ggml-metal runs its
// matrix kernels (simdgroup reduction and simdgroup matrices); Metal 3, and so bfloat, comes with
// it. The second profile is the same GPU with bfloat off (ggml-metal turns it off on some OS
// versions): the step must not depend on it.
enum { DG_OPCHECK_PROFILES = 2 };

static struct ggml_metal_device dg_devices[DG_OPCHECK_PROFILES];
static int dg_devices_ready = 0;

static void dg_init_devices(void) {
    if (dg_devices_ready) {
        return;
    }
    for (int i = 0; i < DG_OPCHECK_PROFILES; ++i) {
        struct ggml_metal_device_props * p = &dg_devices[i].props;
        memset(p, 0, sizeof(*p));
        snprintf(p->name, sizeof(p->name), "%s", i == 0 ? "apple7" : "apple7-no-bfloat");
        p->has_simdgroup_reduction    = true;
        p->has_simdgroup_mm           = true;
        p->has_unified_memory         = true;
        p->has_bfloat                 = i == 0;
        p->has_tensor                 = false;
        p->max_theadgroup_memory_size = 32768;
        p->supports_gpu_family_apple7 = true;
    }
    dg_devices_ready = 1;
}

int dg_opcheck_profiles(void) {
    return DG_OPCHECK_PROFILES;
}

const char * dg_opcheck_profile_name(int profile) {
    dg_init_devices();
    return profile >= 0 && profile < DG_OPCHECK_PROFILES ? dg_devices[profile].props.name : "";
}

int dg_opcheck_metal(const struct ggml_tensor * t, int profile) {
    dg_init_devices();
    return ggml_metal_device_supports_op(&dg_devices[profile], t) ? 1 : 0;
}

// -- records ---------------------------------------------------------------------------------------

static char ** dg_lines    = NULL;
static int     dg_n_lines  = 0;
static int     dg_cap      = 0;

void dg_opcheck_clear(void) {
    for (int i = 0; i < dg_n_lines; ++i) {
        free(dg_lines[i]);
    }
    dg_n_lines = 0;
}

int dg_opcheck_count(void) {
    return dg_n_lines;
}

const char * dg_opcheck_line(int i) {
    return i >= 0 && i < dg_n_lines ? dg_lines[i] : "";
}

// layout letters: c contiguous, 1 / 2 contiguous for dims >= 1 / >= 2, r contiguous rows,
// t transposed, e elements packed (nb[0] == the type's size), 3 contiguous for dims < 3,
// a strides of dims 1..3 multiples of 16 bytes
static void dg_layout(const struct ggml_tensor * t, char * out) {
    int n = 0;
    if (ggml_is_contiguous(t))             out[n++] = 'c';
    if (ggml_is_contiguous_1(t))           out[n++] = '1';
    if (ggml_is_contiguous_2(t))           out[n++] = '2';
    if (ggml_is_contiguous_rows(t))        out[n++] = 'r';
    if (ggml_is_transposed(t))             out[n++] = 't';
    if (t->nb[0] == ggml_type_size(t->type)) out[n++] = 'e';
    if (ggml_is_contiguous_to_3(t))        out[n++] = '3';
    if (t->nb[1] % 16 == 0 && t->nb[2] % 16 == 0 && t->nb[3] % 16 == 0) out[n++] = 'a';
    out[n] = '\0';
}

static int dg_describe(const struct ggml_tensor * t, char * out, size_t size) {
    char layout[16];
    dg_layout(t, layout);
    return snprintf(out, size, "%s:%lld,%lld,%lld,%lld:%s", ggml_type_name(t->type), (long long) t->ne[0],
                    (long long) t->ne[1], (long long) t->ne[2], (long long) t->ne[3], layout);
}

static void dg_record(const struct ggml_tensor * t) {
    char line[2048];
    size_t n = 0;
    const char * sub = "-";
    if (t->op == GGML_OP_UNARY) {
        sub = ggml_unary_op_name(ggml_get_unary_op(t));
    } else if (t->op == GGML_OP_GLU) {
        sub = ggml_glu_op_name(ggml_get_glu_op(t));
    }
    // name, op, sub-op, the node, its four first sources, op_params[0..3], supports_op per profile
    n += snprintf(line + n, sizeof(line) - n, "%s\t%s\t%s\t", t->name, ggml_op_name(t->op), sub);
    n += dg_describe(t, line + n, sizeof(line) - n);
    for (int i = 0; i < 4; ++i) {
        n += snprintf(line + n, sizeof(line) - n, "\t");
        if (t->src[i]) {
            n += dg_describe(t->src[i], line + n, sizeof(line) - n);
        } else {
            n += snprintf(line + n, sizeof(line) - n, "-");
        }
    }
    n += snprintf(line + n, sizeof(line) - n, "\t%d,%d,%d,%d\t%zu\t", t->op_params[0], t->op_params[1],
                  t->op_params[2], t->op_params[3], ggml_backend_metal_buffer_type_get_alloc_size(NULL, t));
    for (int p = 0; p < DG_OPCHECK_PROFILES; ++p) {
        n += snprintf(line + n, sizeof(line) - n, "%s%d", p ? "," : "", dg_opcheck_metal(t, p));
    }
    if (dg_n_lines == dg_cap) {
        dg_cap   = dg_cap ? 2 * dg_cap : 1024;
        dg_lines = (char **) realloc(dg_lines, (size_t) dg_cap * sizeof(char *));
    }
    const size_t len = strlen(line) + 1;
    dg_lines[dg_n_lines] = (char *) malloc(len);
    memcpy(dg_lines[dg_n_lines++], line, len);
}

// ggml_backend_sched_eval_callback: asked about each node before the graph runs; "not needed"
// for all of them keeps the graph in one piece
bool dg_opcheck_eval(struct ggml_tensor * t, bool ask, void * user_data) {
    (void) user_data;
    if (ask) {
        dg_record(t);
    }
    return false;
}

// -- probes: single ops built here, to show that the check tells supported from unsupported ---------

// 0: OUT_PROD [n_embd, k, C] x [1, k, C] (the self-conditioning contraction as ggml_out_prod)
// 1: MUL_MAT of the same operands with the contraction moved to dimension 0
// 2: MUL_MAT of a Q4_K weight by F32 activations
// 3: a CUSTOM op
static void dg_probe_custom(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) dst; (void) ith; (void) nth; (void) userdata;
}

int dg_opcheck_probe(int which, int profile) {
    struct ggml_init_params params = { 16 * 1024 * 1024, NULL, true };
    struct ggml_context * ctx = ggml_init(params);
    struct ggml_tensor * node = NULL;
    const int64_t n_embd = 2816, k = 64, C = 256;
    if (which == 0) {
        struct ggml_tensor * rows = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_embd, k, C);
        struct ggml_tensor * w    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, k, C);
        node = ggml_out_prod(ctx, rows, w);
    } else if (which == 1) {
        struct ggml_tensor * rows_t = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, n_embd, C);
        struct ggml_tensor * w      = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, 1, C);
        node = ggml_mul_mat(ctx, rows_t, w);
    } else if (which == 2) {
        struct ggml_tensor * weight = ggml_new_tensor_2d(ctx, GGML_TYPE_Q4_K, n_embd, 704);
        struct ggml_tensor * act    = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd, C);
        node = ggml_mul_mat(ctx, weight, act);
    } else {
        struct ggml_tensor * a = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd, C);
        node = ggml_custom_4d(ctx, GGML_TYPE_F32, n_embd, C, 1, 1, &a, 1, dg_probe_custom, 1, NULL);
    }
    const int ok = dg_opcheck_metal(node, profile);
    ggml_free(ctx);
    return ok;
}
