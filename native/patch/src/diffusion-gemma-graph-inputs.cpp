// The diffusion-gemma graph's own inputs (diffusion-gemma-graph-inputs.h).

#include "diffusion-gemma-graph-inputs.h"

#include "llama-batch.h"
#include "ggml-backend.h"

#include <vector>

bool llm_graph_input_dg_mode::can_reuse(const llm_graph_params &) {
    return dg_graph_key(dg_active_request()) == key;
}

// ubatch order may differ from batch order: a canvas token's batch row, by (sequence, position)
static int64_t dg_batch_row(const dg_request & req, const llama_ubatch & ubatch, uint32_t i) {
    const llama_seq_id seq = ubatch.seq_id[i][0];
    GGML_ASSERT(seq >= 0 && (size_t) seq < req.pos0.size());
    const int64_t row = req.row_of(seq, ubatch.pos[i]);
    GGML_ASSERT(row >= (int64_t) seq * req.n_canvas && row < (int64_t) (seq + 1) * req.n_canvas);
    return row;
}

void llm_graph_input_dg_self_cond::set_input(const llama_ubatch * ubatch) {
    const dg_request * req = dg_active_request();
    GGML_ASSERT(req && req->sc_form == form && req->sc_width == width && req->sc_values);
    GGML_ASSERT((ids != nullptr) == (req->sc_ids != nullptr));

    const size_t ids_bytes    = (size_t) width * sizeof(int32_t);
    const size_t values_bytes = (size_t) width * sizeof(float);
    for (uint32_t i = 0; i < ubatch->n_tokens; ++i) {
        const size_t row = (size_t) dg_batch_row(*req, *ubatch, i) * (size_t) width;
        if (ids) {
            ggml_backend_tensor_set(ids, req->sc_ids + row, i * ids_bytes, ids_bytes);
        }
        ggml_backend_tensor_set(values, req->sc_values + row, i * values_bytes, values_bytes);
    }
}

bool llm_graph_input_dg_self_cond::can_reuse(const llm_graph_params & params) {
    return values->ne[1] == params.ubatch.n_tokens;
}

void llm_graph_input_dg_step::set_input(const llama_ubatch * ubatch) {
    const dg_request * req = dg_active_request();
    GGML_ASSERT(req && req->step.active);
    const dg_step_request & step = req->step;

    std::vector<float>  temps(ubatch->n_tokens);
    std::vector<double> unif(ubatch->n_tokens);
    step.rows.resize(ubatch->n_tokens);
    for (uint32_t i = 0; i < ubatch->n_tokens; ++i) {
        const int64_t row = dg_batch_row(*req, *ubatch, i);
        step.rows[i] = (int32_t) row;
        temps[i]     = step.temperatures[ubatch->seq_id[i][0]];
        unif[i]      = step.uniforms[row];
    }
    ggml_backend_tensor_set(temperatures, temps.data(), 0, temps.size() * sizeof(float));
    if (uniforms->type == GGML_TYPE_F64) {
        ggml_backend_tensor_set(uniforms, unif.data(), 0, unif.size() * sizeof(double));
    } else {
        std::vector<float> unif32(unif.begin(), unif.end());
        ggml_backend_tensor_set(uniforms, unif32.data(), 0, unif32.size() * sizeof(float));
    }
    step.record    = record;
    step.values    = values;
    step.soft_embd = soft_embd;
}

bool llm_graph_input_dg_step::can_reuse(const llm_graph_params & params) {
    return temperatures->ne[1] == params.ubatch.n_tokens;
}
