// Timing shared by the standalone kernel probes (expert_tile_probe.cpp, avx2_q4k_tile_probe.cpp,
// amx_probe.cpp): the calling thread's CPU time, so that a wait for a core on a shared machine is left out.
#pragma once

#include <algorithm>
#include <ctime>

inline double cpu_now_s() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

// best G MAC/s of `run()` (returning multiply-adds) over 5 rounds
template <typename Run> double best_rate(Run run) {
    double best = 0.0;
    for (int round = 0; round < 5; ++round) {
        const double t0   = cpu_now_s();
        const double macs = run();
        best              = std::max(best, macs / (cpu_now_s() - t0) / 1e9);
    }
    return best;
}
