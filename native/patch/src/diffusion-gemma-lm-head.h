#pragma once
// Internal: the LM head of a Q8_0 embedding (262144 x 2816 on the real model, ~75% of a CPU
// denoising step's multiply-adds) as a GEMM of our own, on a lossless repack of the matrix.
//
// ggml runs it through llamafile's tinyBLAS (256-bit, one row against one column per dot
// product, about half the int8 rate of the core). Here the quants of `group` consecutive rows are
// interleaved four at a time, so that one vector load holds quants k..k+3 of every row of the
// group and each 32-bit lane accumulates one row: one int8 dot-product instruction per
// (group, column, 4 quants). The values are the file's, bit for bit (same quants, same fp16
// scales); the repack adds each row-block's quant sum (for VNNI's unsigned operand), 6% more
// bytes than Q8_0.
//
// Kernels, chosen once per model by the CPU (DG_LM_HEAD overrides: ggml | avx2 | emulated):
//   avx512-vnni  16-row groups, vpdpbusd zmm on (activation + 128) x quant, minus 128 x quant sum
//   avx2         8-row groups, vpmaddubsw on |quant| x sign-adjusted activation, vpmaddwd
//   emulated     the avx512-vnni layout and arithmetic in portable code (tests, any CPU)
// Other CPUs, other types (F16, ...), and LM heads not in plain host memory keep ggml's matmul; a Q4_K
// or Q6_K LM head (Q4_K_M files) runs on dg_experts' K-quant tiles below. Nothing here is specific to the vocabulary: the decoder's other dense Q8_0
// projections (attention, dense FFN, self-conditioning MLP) run through the same class, and so do
// its Q5_0 ones (Q4_K_M files store the down projections, whose rows are not whole 256-wide
// super-blocks, as Q5_0; ggml's Q5_0 matmul runs at about 40% of the int8 rate here).

#include "ggml.h"

#include <cstdint>
#include <memory>
#include <vector>

enum class dg_lm_head_kernel : int32_t {
    none        = 0, // ggml's matmul
    avx2        = 1,
    avx512_vnni = 2,
    emulated    = 3,
};

class dg_lm_head {
public:
    // The kernel this CPU asks for, unless the environment variable `env` (DG_LM_HEAD for the LM
    // head, DG_DENSE_GEMM for the decoder's other projections) names one: ggml | avx2 | avx512-vnni |
    // emulated; where `env` is unset or auto, DG_CPU_KERNELS names the family for every component.
    // A kernel this CPU lacks means ggml's.
    static dg_lm_head_kernel kernel_for_cpu(const char * env = "DG_LM_HEAD");
    static const char *      kernel_name(dg_lm_head_kernel kernel);

    // Whether `w` can be repacked: Q8_0 or Q5_0 [n_embd, n_vocab] in plain host memory (not on a
    // GPU, not already repacked by a CPU extra buffer type). Q5_0's quants minus 16 are int8 quants
    // under the same scale, so its repack is as lossless as Q8_0's (and 64% larger than the Q5_0).
    static bool qualifies(const ggml_tensor * w);

    // A repack of `w` for `kernel`; null if the tensor does not qualify or the CPU lacks the kernel.
    static std::unique_ptr<dg_lm_head> repack(const ggml_tensor * w, dg_lm_head_kernel kernel);
    // The same from raw rows of `type`, Q8_0 or Q5_0 (tests).
    static std::unique_ptr<dg_lm_head> repack(const void * rows, ggml_type type, int64_t n_embd, int64_t n_vocab,
                                              dg_lm_head_kernel kernel);

    // An all-zero repack of [n_embd, n_vocab] for `kernel`, to be filled with pack_blocks, a range of blocks
    // of every row at a time (the transposed embeddings are made that way, without a whole Q8_0 copy
    // in between); null if the CPU lacks the kernel or n_embd is not whole blocks.
    static std::unique_ptr<dg_lm_head> zeros(int64_t n_embd, int64_t n_vocab, dg_lm_head_kernel kernel);
    // Blocks [b0, b0 + n_blocks) of every row from Q8_0 rows holding just those blocks (row v at
    // rows + v * row_bytes). Calls for disjoint block ranges may run on different threads.
    void pack_blocks(const void * rows, size_t row_bytes, int64_t b0, int64_t n_blocks);

    dg_lm_head_kernel kernel() const { return kernel_; }
    int64_t           n_embd() const { return n_embd_; }
    int64_t           n_vocab() const { return n_vocab_; }

    // Bytes of one quantized activation column (see quantize).
    int64_t act_bytes() const;

    // Columns [c0, c1) of x (F32, column c at x + c * ld_x) quantized as ggml quantizes the
    // activations of a Q8_0 matmul (per 32 values: d = amax / 127 as fp16, round-to-even of
    // x * 127 / amax), into act (column c at act + c * act_bytes(), per chunk_blocks() its quants then
    // their scales).
    void quantize(const float * x, int64_t ld_x, int64_t c0, int64_t c1, uint8_t * act) const;

    // out[c * ld_out + v] for the vocabulary rows of groups [g0, g1) (group_rows() rows each)
    // and every column of act.
    void gemm(const uint8_t * act, int64_t n_cols, float * out, int64_t ld_out, int64_t g0, int64_t g1) const;

    // Blocks of a row the GEMM multiplies at a time (all of them, unless the rows are long): quantize
    // lays each chunk's quants and then its scales out together.
    int64_t chunk_blocks() const;

    int64_t group_rows() const { return group_; }
    int64_t bytes() const;  // of the repacked matrix
    int64_t n_groups() const { return (n_vocab_ + group_ - 1) / group_; }

    // Whether quantize stores the activations + 128 (the unsigned operand): the VNNI layout's tiles, and
    // AVX2's for Q5_0 weights (tile_q5_0_avx2) or on AVX-VNNI (tile_q8_0_avxvnni)
    bool activations_plus_128() const;

private:
    dg_lm_head(dg_lm_head_kernel kernel, int64_t n_embd, int64_t n_vocab);

    dg_lm_head_kernel kernel_;
    int64_t           n_embd_;
    int64_t           n_vocab_;
    int64_t           n_blocks_; // n_embd / 32
    int64_t           group_;    // rows per group: 16 for the VNNI layout, 8 for AVX2
    bool              amx_;      // the VNNI layout's 16-column tiles on AMX (amx_wanted)
    bool              avx_vnni_; // the AVX2 layout's tiles on AVX-VNNI (avx_vnni_wanted)
    ggml_type         type_ = GGML_TYPE_Q8_0; // the rows repacked: Q8_0 or Q5_0 (quants -16..15)
    // per (group, block): group fp16 scales, group int16 quant sums, then 8 x (group x 4) quants
    std::vector<uint8_t, std::allocator<uint8_t>> data_;
    uint8_t * base_ = nullptr; // data_ aligned to 64 bytes

    friend struct dg_lm_head_access;
};

// ggml custom ops over a dg_lm_head (userdata): activations [n_embd, n_cols] F32 -> quantized
// columns (I8 [act_bytes, n_cols]), and those -> logits F32 [n_vocab, n_cols].
void dg_lm_head_quantize_op(ggml_tensor * dst, int ith, int nth, void * userdata);
void dg_lm_head_gemm_op(ggml_tensor * dst, int ith, int nth, void * userdata);

// MUL_MAT_ID of Q8_0, Q5_0, Q4_K or Q6_K experts [n_in, n_out, n_expert] (every expert of a Q8_0 file; the
// gate+up and down projections of a Q4_K_M one) on the same tiles, without a copy of the experts: a
// thread packs one row group of one expert at a time into the tiles' layout (n_in / 32 x 288 bytes on
// AVX2: 6 KiB for the real down projection, in L1) and runs it against every token routed to that
// expert (about 16 of a 256-token canvas on the real model: 8 of 128 experts per token). ggml's
// per-expert sgemm decodes each weight block once per few columns and runs at 44% (Q5_0) to 50% (Q8_0)
// of the int8 rate here; its repacked Q4_K MUL_MAT_ID runs one token at a time, at ~64%.
// Q4_K has a tile of its own, AVX2 only: per 256-wide super-block the unsigned quants as bytes with
// each sub-block's scale d * sc and offset dmin * m as floats (n_in / 256 x 2560 bytes), against
// activations quantized as ggml quantizes them for Q4_K (Q8_K: one scale per 256) with each
// sub-block's quant sum, which the offsets multiply.
// Q6_K too (AVX2): per super-block the quants minus 32 as int8, each 16-wide sub-block's int8 scale, and
// per row a correction; the activations (Q8_K, as ggml quantizes them for Q6_K) are stored + 128, the
// unsigned operand of vpmaddubsw, and the correction (128 x the row's scaled quant sums) takes that back.
// Packed on the fly for the VNNI family where the CPU has AMX (amx_k_quant(): the route its dense Q4_K and
// Q6_K weights take), 16-row groups of AMX B tiles per 64 quants: each weight's sc * q (Q4_K, unsigned) or
// sc * (q - 32) (Q6_K, signed) split into a high and a low byte, the rows' d (and Q4_K's offsets dmin * m)
// as floats; the activations are the signed Q8_K quants.
// The values are the same quantized products as ggml's (its activation quantization, the file's
// quants and scales); only the float summation order differs.
//
// Repacked experts (the main route since the experts moved to dg's extra buffer type,
// diffusion-gemma-experts.cpp): the loader hands a tensor's file rows to the buffer once, which stores
// them in a layout of the kernel's own (repack()), about the file's size: row groups of 16 (VNNI) or 8
// (AVX2) rows, each block's quants interleaved 4 at a time across the group, the scales beside them
// in the group's order; Q4_K and Q6_K keep their nibble and 2-bit planes and Q5_0 its fifth bits, so
// that a group is made ready for the tiles by a few vector ops per 4 quants (stage()), Q8_0 by none.
class dg_experts {
public:
    // The kernel of the on-the-fly route for this CPU (DG_EXPERT_GEMM / DG_CPU_KERNELS override, as
    // DG_LM_HEAD does the LM head's): experts in plain host memory, each row group packed from the
    // file's layout when used. Not avx512-vnni, whose pack is portable code; that family runs the
    // repacked route (repack_kernel_for_cpu).
    static dg_lm_head_kernel kernel_for_cpu();
    // The kernel of the repacked route (avx2 or avx512-vnni; none: ggml's MUL_MAT_ID), the same
    // variables read.
    static dg_lm_head_kernel repack_kernel_for_cpu();
    // Whether experts of `type` with rows n_in wide have a repacked layout for `kernel`: Q8_0, Q5_0,
    // Q4_K and Q6_K (whole blocks), avx2 or avx512-vnni where the CPU has it.
    static bool repack_takes(ggml_type type, int64_t n_in, dg_lm_head_kernel kernel);
    // Bytes of [n_in, n_out, n_expert] experts in the repacked layout.
    static size_t repacked_bytes(ggml_type type, int64_t n_in, int64_t n_out, int64_t n_expert,
                                 dg_lm_head_kernel kernel);
    // Experts [e0, e1) of the file's rows `src` (expert e at src + e * n_out * row bytes) into the
    // repacked layout of the whole tensor at `dst`; rows past n_out of a last group are zeros.
    static void repack(ggml_type type, int64_t n_in, int64_t n_out, int64_t e0, int64_t e1, dg_lm_head_kernel kernel,
                       const void * src, void * dst);
    // A GEMM over experts already in the repacked layout (null if repack_takes says no).
    static std::unique_ptr<dg_experts> over_repacked(const void * data, ggml_type type, int64_t n_in, int64_t n_out,
                                                     int64_t n_expert, dg_lm_head_kernel kernel);

    // Q8_0, Q5_0, Q4_K or Q6_K, [n_in, n_out, n_expert] (or a 2-D weight: one expert) in plain host memory
    // (not in a CPU repack buffer), n_in whole blocks
    static bool qualifies(const ggml_tensor * w);
    // null if `w` does not qualify or the CPU lacks the kernel; keeps a pointer to w's data
    static std::unique_ptr<dg_experts> make(const ggml_tensor * w, dg_lm_head_kernel kernel);
    // the same over raw experts: row r of expert e at data + (e * n_out + r) * row bytes (tests)
    static std::unique_ptr<dg_experts> make(const void * data, ggml_type type, int64_t n_in, int64_t n_out,
                                            int64_t n_expert, dg_lm_head_kernel kernel);

    dg_lm_head_kernel kernel() const { return kernel_; }
    int64_t           n_in() const { return n_in_; }
    int64_t           n_out() const { return n_out_; }
    int64_t           n_expert() const { return n_expert_; }
    int64_t           act_bytes() const; // of one quantized activation row
    // the fewest tokens a dense product should have to run here rather than on ggml's matmul: a
    // group's packing costs about 3 columns of AVX2 tile work, 16 of AMX's, 8 of VNNI's span tiles
    int64_t           min_dense_tokens() const { return amx_k_quant() || vnni_k_quant_on_the_fly() ? 16 : 4; }
    // Q4_K and Q6_K packed on the fly for the VNNI family: on AMX's tiles where AMX runs, else into the
    // repacked layout for the span tiles
    bool              amx_k_quant() const;
    bool              vnni_k_quant_on_the_fly() const;
    // the repacked Q8_0 / Q5_0 experts on VNNI's span tiles: activations signed, with each block's start
    // after the scales (act_bytes), the stored quants unsigned
    bool              signed_activations() const;
    // the AVX2 family's Q8_0 / Q5_0 tile reads the activations + 128 (tile_q5_0_avx2, AVX-VNNI's)
    bool              avx2_activations_plus_128() const;

    // rows [r0, r1) of x (F32, row r at x + r * ld_x) quantized as dg_lm_head::quantize does; `scalar`:
    // the portable loops even where the CPU has AVX2 (the self-test compares the two)
    void quantize(const float * x, int64_t ld_x, int64_t r0, int64_t r1, uint8_t * act, bool scalar = false) const;

    // out(slot, token) = expert ids[slot + token * ld_ids] x activation row (slot % n_act_slots) +
    // token * n_act_slots of act, for every slot < n_used and token < n_tokens; out(slot, token) is
    // the n_out floats at out + slot * nb_slot + token * nb_token (bytes). n_act_slots: 1 when every
    // expert of a token reads the same input (gate and up), n_used when each has its own (down).
    // Thread ith of nth computes its share of the (expert, row group) pairs.
    void gemm(const uint8_t * act, int64_t n_act_slots, const int32_t * ids, int64_t ld_ids, int64_t n_used,
              int64_t n_tokens, char * out, size_t nb_slot, size_t nb_token, int ith, int nth) const;

private:
    dg_experts(dg_lm_head_kernel kernel, const void * data, ggml_type type, int64_t n_in, int64_t n_out,
               int64_t n_expert);

    int64_t group_bytes() const; // of one packed row group
    // rows [0, rows) of the group at first_row, packed into `group` (rows past them compute zeros)
    void pack(const uint8_t * first_row, int64_t rows, uint8_t * group) const;
    // row group g of expert e in the tiles' layout: packed from the file's rows into `buffer`,
    // unpacked there from the repacked layout, or (repacked Q8_0) where it is stored
    const uint8_t * stage(int64_t e, int64_t g, uint8_t * buffer) const;
    // Bytes of one row group in the repacked layout.
    static int64_t stored_group_bytes(ggml_type type, int64_t n_in, dg_lm_head_kernel kernel);

    dg_lm_head_kernel kernel_;
    const uint8_t *   data_;
    ggml_type         type_;
    int64_t           n_in_;
    int64_t           n_out_;
    int64_t           n_expert_;
    int64_t           n_blocks_; // n_in / 32
    int64_t           group_;    // 16 for the VNNI layout, 8 for AVX2
    size_t            row_bytes_;
    bool              repacked_ = false; // data_ in the repacked layout, not the file's
    bool              amx_;              // AMX's tiles wanted when this was made (amx_k_quant)
    bool              avx_vnni_;         // the AVX2 layouts' tiles on AVX-VNNI (avx_vnni_wanted)
};

// ggml custom ops over a dg_experts (userdata): activations [n_in, rows] F32 -> quantized rows
// (I8 [act_bytes, rows]); those (src[0]) and the selected experts (src[1], I32 [n_used, n_tokens]) ->
// F32 [n_out, n_used, n_tokens].
void dg_experts_quantize_op(ggml_tensor * dst, int ith, int nth, void * userdata);
void dg_experts_gemm_op(ggml_tensor * dst, int ith, int nth, void * userdata);
// A dense weight as one expert every token is routed to: quantized rows (src[0]) -> F32 [n_out, n_tokens].
void dg_experts_dense_op(ggml_tensor * dst, int ith, int nth, void * userdata);

// Bytes of one (group, block) of the repack.
inline int64_t dg_lm_head_group_block_bytes(int64_t group) {
    return 2 * group + 2 * group + 32 * group;
}

// Whether `t` sits repacked in one of dg's expert buffers (diffusion-gemma-experts.cpp).
bool dg_expert_tensor_repacked(const ggml_tensor * t);
