// dg_profile_* (include/diffusion-gemma.h): the time of every graph node, through llama.cpp's
// per-node eval callback. With the callback asking for every node, the scheduler computes the
// graph one node at a time and calls back before (ask) and after each: the time between the two
// is that node's, as wall time and as the process's CPU time (all threads; on a shared machine
// the CPU time is what the node cost, the wall time also holds the waits for a core). Slower
// than an uninterrupted graph (a thread-pool round per node), so for finding where a step goes,
// not for end-to-end numbers.

#include "diffusion-gemma.h"

#include "ggml.h"

#include <chrono>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

struct dg_profile {
    struct node {
        std::string name;
        std::string op;
        ggml_type   type = GGML_TYPE_F32;     // the node's own type
        ggml_type   src_type[3] = { GGML_TYPE_COUNT, GGML_TYPE_COUNT, GGML_TYPE_COUNT };
        int64_t     ne[4][4] = {};            // the node, then its first three sources
        double      seconds = 0.0;     // wall
        double      cpu_seconds = 0.0; // the process's CPU time, all threads
    };

    std::vector<node> nodes;
    double            asked_at = 0.0;
    double            asked_cpu = 0.0;
    bool              enabled  = false; // disabled: every node declined, the graph runs uninterrupted
};

static double dg_now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static double dg_cpu_s() {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

dg_profile * dg_profile_new(void) {
    return new dg_profile();
}

void dg_profile_free(dg_profile * p) {
    delete p;
}

void dg_profile_reset(dg_profile * p) {
    if (p) {
        p->nodes.clear();
    }
}

void dg_profile_enable(dg_profile * p, bool enabled) {
    if (p) {
        p->enabled = enabled;
    }
}

bool dg_profile_enabled(const dg_profile * p) {
    return p && p->enabled;
}

bool dg_profile_eval(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * p = (dg_profile *) user_data;
    if (ask) {
        p->asked_at  = dg_now_s();
        p->asked_cpu = dg_cpu_s();
        return p->enabled;
    }
    dg_profile::node n;
    n.seconds     = dg_now_s() - p->asked_at;
    n.cpu_seconds = dg_cpu_s() - p->asked_cpu;
    n.name    = ggml_get_name(t);
    n.op      = ggml_op_desc(t);
    n.type    = t->type;
    for (int d = 0; d < 4; ++d) {
        n.ne[0][d] = t->ne[d];
    }
    for (int s = 0; s < 3; ++s) {
        if (t->src[s]) {
            n.src_type[s] = t->src[s]->type;
            for (int d = 0; d < 4; ++d) {
                n.ne[s + 1][d] = t->src[s]->ne[d];
            }
        }
    }
    p->nodes.push_back(std::move(n));
    return true;
}

int32_t dg_profile_count(const dg_profile * p) {
    return p ? (int32_t) p->nodes.size() : 0;
}

int32_t dg_profile_node(const dg_profile * p, int32_t i, char * name, int32_t name_len, char * op, int32_t op_len,
                        char * src0_type, int32_t type_len, int64_t * ne, double * seconds, double * cpu_seconds) {
    if (!p || i < 0 || i >= (int32_t) p->nodes.size()) {
        return -1;
    }
    const auto & n = p->nodes[(size_t) i];
    auto copy = [](char * out, int32_t len, const std::string & s) {
        if (out && len > 0) {
            std::strncpy(out, s.c_str(), (size_t) len - 1);
            out[len - 1] = '\0';
        }
    };
    copy(name, name_len, n.name);
    copy(op, op_len, n.op);
    copy(src0_type, type_len, n.src_type[0] == GGML_TYPE_COUNT ? std::string("-") : ggml_type_name(n.src_type[0]));
    if (ne) {
        std::memcpy(ne, n.ne, sizeof(n.ne));
    }
    if (seconds) {
        *seconds = n.seconds;
    }
    if (cpu_seconds) {
        *cpu_seconds = n.cpu_seconds;
    }
    return 0;
}
