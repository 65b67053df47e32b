// Estimation: how a draft is read off a match (the walk) and how verification outcomes are
// predicted and chosen (the outcome model, the calibration, the allocator).
//
// These follow ngramrl/core/drafter.py (NgramDrafter.walk) and ngramrl/core/outcome.py line by
// line, with the same floating-point operations in the same order, so drafts, probabilities and
// outcomes are bit-identical to the reference. They only read an Automaton: when the reference
// algorithm changes (how continuations are estimated, path and length choice), this file is
// the one to follow it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "automaton.hpp"

namespace ngramrl {

enum Source : int8_t { SOURCE_NONE = 0, SOURCE_PROMPT = 1, SOURCE_GLOBAL = 2 };

struct DraftOut {
    std::vector<int32_t> tokens;
    std::vector<double> probs;
    int32_t matched = 0;
    int8_t source = SOURCE_NONE;

    void clear() {
        tokens.clear();
        probs.clear();
        matched = 0;
        source = SOURCE_NONE;
    }
};

struct WalkConfig {
    int32_t min_match = 1;
    double min_confidence = 0.0;
    std::vector<int32_t> stop_tokens;

    bool is_stop(int32_t token) const {
        for (int32_t s : stop_tokens)
            if (s == token) return true;
        return false;
    }
};

// NgramDrafter.walk: follow the most frequent continuation from a match, backing off where
// the occurrences being followed end.
inline void walk(const Automaton& a, Match m, int32_t k, int8_t source, const WalkConfig& config, DraftOut& out) {
    out.clear();
    int32_t state = m.state;
    int32_t matched = std::min(m.matched, a[m.state].length);
    const int32_t min_match = config.min_match;
    while (a[state].best_token < 0 && a[state].length > min_match) {
        state = a[state].link;
        matched = a[state].length;
    }
    if (a[state].best_token < 0 || matched < min_match) {
        out.matched = matched;
        return;
    }
    out.matched = matched;
    out.source = source;
    double survive = 1.0;
    while (true) {
        const auto& s = a[state];
        const int32_t token = s.best_token, child = s.best_state;
        // Witten-Bell: unseen continuations get the mass of one per distinct token seen.
        const double p = static_cast<double>(a[child].count) /
                         static_cast<double>(static_cast<int64_t>(s.followed) + (s.kids < 0 ? 1 : a.num_children(state)));
        survive *= p;
        if (survive < config.min_confidence) break;
        out.tokens.push_back(token);
        out.probs.push_back(p);
        if (static_cast<int32_t>(out.tokens.size()) >= k || config.is_stop(token)) break;
        state = child;
        while (a[state].best_token < 0 && a.length_at(a[state].link) >= min_match) state = a[state].link;
        if (a[state].best_token < 0) break;
    }
}

struct SourceMatch {
    const Automaton* index;
    Match match;
};

// outcome.token_distribution: up to ``limit`` likeliest next tokens other than ``exclude``.
inline void token_distribution(const SourceMatch* sources, size_t num_sources, int32_t exclude, int32_t levels,
                               int32_t limit, double floor, std::vector<std::pair<double, int32_t>>& out) {
    thread_local std::vector<std::pair<int32_t, int32_t>> ranked;
    thread_local std::vector<std::pair<int32_t, double>> parts;  // (token, contribution) in the reference's order
    thread_local std::vector<int32_t> order;
    parts.clear();
    double mass = 1.0;
    for (size_t si = 0; si < num_sources; ++si) {
        const Automaton& a = *sources[si].index;
        int32_t state = sources[si].match.state;
        int32_t used = 0;
        while (used < levels && mass > floor) {
            const int32_t total = a.ranked(state, static_cast<size_t>(limit) + 1, ranked);
            if (total > 0) {
                used += 1;
                int64_t norm = static_cast<int64_t>(a[state].followed) + total;
                const int32_t excluded = exclude >= 0 ? a.child(state, exclude) : -1;
                if (excluded >= 0) norm -= a[excluded].count;
                if (norm <= 0) break;
                const double scale = mass / static_cast<double>(norm);
                for (const auto& tc : ranked)
                    if (tc.first != exclude) parts.emplace_back(tc.first, scale * static_cast<double>(tc.second));
                mass *= static_cast<double>(total) / static_cast<double>(norm);
            }
            if (state == ROOT) break;
            state = a[state].link;
        }
    }
    // Sum each token's contributions in the order they came (the reference's dict updates), in a
    // small open-addressing table (generation-stamped, so it is never cleared).
    thread_local std::vector<int32_t> slot_token, slot_sum_at;
    thread_local std::vector<uint32_t> slot_gen;
    thread_local uint32_t gen = 0;
    thread_local std::vector<double> sums;
    size_t size = 64;
    while (size < 2 * parts.size()) size *= 2;
    if (slot_gen.size() < size) {
        slot_token.assign(size, 0);
        slot_sum_at.assign(size, 0);
        slot_gen.assign(size, 0);
    } else {
        size = slot_gen.size();
    }
    if (++gen == 0) {
        std::fill(slot_gen.begin(), slot_gen.end(), 0);
        gen = 1;
    }
    sums.clear();
    order.clear();  // the tokens, in first-seen order
    const size_t mask = size - 1;
    for (const auto& part : parts) {
        size_t at = (static_cast<uint32_t>(part.first) * 2654435761u) & mask;
        while (slot_gen[at] == gen && slot_token[at] != part.first) at = (at + 1) & mask;
        if (slot_gen[at] != gen) {
            slot_gen[at] = gen;
            slot_token[at] = part.first;
            slot_sum_at[at] = static_cast<int32_t>(sums.size());
            sums.push_back(0.0);
            order.push_back(part.first);
        }
        double& sum = sums[slot_sum_at[at]];
        sum = sum + part.second;
    }
    out.clear();
    for (size_t i = 0; i < sums.size(); ++i)
        if (sums[i] > floor) out.emplace_back(sums[i], order[i]);
    std::sort(out.begin(), out.end(), [](const std::pair<double, int32_t>& x, const std::pair<double, int32_t>& y) {
        return x.first != y.first ? x.first > y.first : x.second > y.second;
    });
    if (static_cast<int32_t>(out.size()) > limit) out.resize(limit);
}

struct OutcomeOut {
    double probability;
    int32_t accepted;
    int32_t token;
};

inline bool outcome_less(const OutcomeOut& x, const OutcomeOut& y) {  // Python's (p, j, b) tuple order
    if (x.probability != y.probability) return x.probability < y.probability;
    if (x.accepted != y.accepted) return x.accepted < y.accepted;
    return x.token < y.token;
}

// outcome.predict_outcomes: the ``limit`` most probable (j, b), most probable first.
inline void predict_outcomes(const SourceMatch* sources, size_t num_sources, const int32_t* tokens, int32_t k,
                             const double* chances, int32_t limit, int32_t levels, std::vector<OutcomeOut>& out) {
    out.clear();
    if (limit <= 0 || num_sources == 0) return;
    thread_local std::vector<double> p_accepted;
    thread_local std::vector<int32_t> order;
    thread_local std::vector<std::vector<Match>> chains;
    thread_local std::vector<SourceMatch> at_j;
    thread_local std::vector<std::pair<double, int32_t>> dist;
    p_accepted.clear();
    double survive = 1.0;
    for (int32_t i = 0; i < k; ++i) {
        p_accepted.push_back(survive * (1.0 - chances[i]));
        survive *= chances[i];
    }
    p_accepted.push_back(survive);
    order.resize(k + 1);
    for (int32_t j = 0; j <= k; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [](int32_t x, int32_t y) { return p_accepted[x] > p_accepted[y]; });
    if (chains.size() < num_sources) chains.resize(num_sources);
    for (size_t s = 0; s < num_sources; ++s) {
        chains[s].clear();
        chains[s].push_back(sources[s].match);
    }
    at_j.resize(num_sources);
    auto heap_greater = [](const OutcomeOut& x, const OutcomeOut& y) { return outcome_less(y, x); };  // min-heap
    for (int32_t j : order) {
        const double pj = p_accepted[j];
        if (static_cast<int32_t>(out.size()) == limit && pj <= out.front().probability) break;
        for (size_t s = 0; s < num_sources; ++s) {
            std::vector<Match>& chain = chains[s];
            while (static_cast<int32_t>(chain.size()) <= j)
                chain.push_back(sources[s].index->step(chain.back(), tokens[chain.size() - 1]));
            at_j[s] = SourceMatch{sources[s].index, chain[j]};
        }
        const double floor = static_cast<int32_t>(out.size()) == limit ? out.front().probability / pj : 0.0;
        token_distribution(at_j.data(), num_sources, j < k ? tokens[j] : -1, levels, limit, floor, dist);
        for (const auto& pt : dist) {
            const double p = pj * pt.first;
            if (static_cast<int32_t>(out.size()) < limit) {
                out.push_back(OutcomeOut{p, j, pt.second});
                std::push_heap(out.begin(), out.end(), heap_greater);
            } else if (p > out.front().probability) {
                std::pop_heap(out.begin(), out.end(), heap_greater);
                out.back() = OutcomeOut{p, j, pt.second};
                std::push_heap(out.begin(), out.end(), heap_greater);
            } else {
                break;  // tokens come most likely first
            }
        }
    }
    std::sort(out.begin(), out.end(), [](const OutcomeOut& x, const OutcomeOut& y) { return outcome_less(y, x); });
}

// outcome.AcceptanceCalibration: acceptance per (position bucket, estimate decile).
class Calibration {
public:
    static constexpr int kBuckets = 6, kDeciles = 10;

    Calibration(double prior_strength, double decay) : prior_strength_(prior_strength), decay_(decay) {}

    static int bucket(int position) { return position < 4 ? position : position < 8 ? 4 : 5; }
    static int decile(double estimate) { return std::min(9, static_cast<int>(estimate * 10)); }

    double chance(int position, double estimate) const {
        const int b = bucket(position), d = decile(estimate);
        const Cell& cell = cells_[b][d];
        if (!cell.seen) return estimate;
        return (cell.accepted + prior_strength_ * estimate) / (cell.trials + prior_strength_);
    }

    void observe(const double* probs, int n, int accepted) {
        const int upto = std::min(n, accepted + 1);
        for (int position = 0; position < upto; ++position) {
            const int b = bucket(position), d = decile(probs[position]);
            Cell& cell = cells_[b][d];
            if (!cell.seen) {
                cell.seen = true;
                order_.emplace_back(b, d);
            }
            cell.accepted = decay_ * cell.accepted + (position < accepted ? 1 : 0);
            cell.trials = decay_ * cell.trials + 1;
        }
    }

    // [bucket, decile, accepted, trials] per cell, in the order cells were first seen.
    std::vector<std::vector<double>> state() const {
        std::vector<std::vector<double>> out;
        for (const auto& bd : order_) {
            const Cell& cell = cells_[bd.first][bd.second];
            out.push_back({static_cast<double>(bd.first), static_cast<double>(bd.second), cell.accepted, cell.trials});
        }
        return out;
    }

    void load_state(const std::vector<std::vector<double>>& state) {
        for (auto& row : cells_)
            for (auto& cell : row) cell = Cell{};
        order_.clear();
        for (const auto& r : state) {
            const int b = static_cast<int>(r.at(0)), d = static_cast<int>(r.at(1));
            if (b < 0 || b >= kBuckets || d < 0 || d >= kDeciles) continue;
            Cell& cell = cells_[b][d];
            if (!cell.seen) order_.emplace_back(b, d);
            cell = Cell{true, r.at(2), r.at(3)};
        }
    }

private:
    struct Cell {
        bool seen = false;
        double accepted = 0.0;
        double trials = 0.0;
    };
    double prior_strength_, decay_;
    Cell cells_[kBuckets][kDeciles];
    std::vector<std::pair<int, int>> order_;
};

// cost.choose_draft_lengths and probe_lengths over calibrated survival chances, and the accepted
// tokens the unscaled chances expect of what is kept (the proposer's _lengths).
struct LengthChoice {
    std::vector<int32_t> lengths;
    double expected = 0.0;
    bool paid = false;    // the cost model (not a probe) kept a token
    bool probed = false;  // a probe chose the lengths
};

inline void choose_lengths(const Calibration& calibration, const double* probs, const int64_t* offsets, size_t rows,
                           double scale, const double coefficients[4], double min_gain, bool adaptive,
                           int32_t probe_tokens, LengthChoice& out) {
    out.lengths.assign(rows, 0);
    out.expected = 0.0;
    out.paid = false;
    out.probed = false;
    std::vector<double> survival(offsets[rows]), scaled(offsets[rows]);
    bool any = false;
    for (size_t r = 0; r < rows; ++r) {
        double running = 1.0, running_scaled = scale;
        for (int64_t j = offsets[r]; j < offsets[r + 1]; ++j) {
            const double chance = calibration.chance(static_cast<int>(j - offsets[r]), probs[j]);
            running *= chance;
            running_scaled *= chance;
            survival[j] = running;
            scaled[j] = running_scaled;
        }
        any = any || offsets[r + 1] > offsets[r];
    }
    if (!any) return;
    struct Next {
        double s;
        int64_t r, i;
    };
    // _best_first: likeliest first, ties to the lower row, then the lower index (a heap of (-s, r, i)).
    auto later = [](const Next& a, const Next& b) {
        if (a.s != b.s) return a.s < b.s;
        if (a.r != b.r) return a.r > b.r;
        return a.i > b.i;
    };
    auto best_first = [&](const std::vector<double>& values, auto&& take) {
        std::vector<Next> heap;
        for (size_t r = 0; r < rows; ++r)
            if (offsets[r + 1] > offsets[r]) heap.push_back(Next{values[offsets[r]], static_cast<int64_t>(r), 0});
        std::make_heap(heap.begin(), heap.end(), later);
        while (!heap.empty()) {
            std::pop_heap(heap.begin(), heap.end(), later);
            const Next n = heap.back();
            heap.pop_back();
            if (!take(n)) return;
            if (offsets[n.r] + n.i + 1 < offsets[n.r + 1]) {
                heap.push_back(Next{values[offsets[n.r] + n.i + 1], n.r, n.i + 1});
                std::push_heap(heap.begin(), heap.end(), later);
            }
        }
    };
    if (!adaptive) {
        for (size_t r = 0; r < rows; ++r) out.lengths[r] = static_cast<int32_t>(offsets[r + 1] - offsets[r]);
        out.paid = true;
    } else {
        const double base = coefficients[0], per_request = coefficients[1], per_token = coefficients[2],
                     per_verify = coefficients[3];
        const double demand = 1.0 + min_gain;
        if (per_token <= 0.0 && per_verify <= 0.0) {
            for (size_t r = 0; r < rows; ++r) out.lengths[r] = static_cast<int32_t>(offsets[r + 1] - offsets[r]);
        } else {
            const double plain = static_cast<double>(rows);
            const double plain_time = base + per_request * static_cast<double>(rows);
            double committed = plain, time = plain_time + per_verify;
            best_first(scaled, [&](const Next& n) {
                if (n.s * time <= demand * per_token * committed) return false;
                out.lengths[n.r] = static_cast<int32_t>(n.i) + 1;
                committed += n.s;
                time += per_token;
                return true;
            });
            if (committed * plain_time <= demand * plain * time) out.lengths.assign(rows, 0);
        }
        for (int32_t n : out.lengths) out.paid = out.paid || n > 0;
        if (probe_tokens > 0 && !out.paid) {
            out.lengths.assign(rows, 0);
            int32_t left = probe_tokens;
            best_first(survival, [&](const Next& n) {
                if (left-- <= 0) return false;
                out.lengths[n.r] = static_cast<int32_t>(n.i) + 1;
                return true;
            });
            out.probed = true;
        }
    }
    for (size_t r = 0; r < rows; ++r) {
        double sum = 0.0;
        for (int32_t i = 0; i < out.lengths[r]; ++i) sum = sum + survival[offsets[r] + i];
        out.expected = out.expected + sum;
    }
}

struct AllocateConfig {
    int32_t budget = 16;
    int64_t global_budget = -1;  // -1: none
    double min_probability = 0.0;
};

// outcome.allocate over rows: which outcomes of each row to prefetch. ``keys`` break ties
// across rows as the reference's dictionary keys do (the request handles).
inline void allocate(const std::vector<std::vector<OutcomeOut>>& candidates, const std::vector<int64_t>& keys,
                     const AllocateConfig& config, std::vector<std::vector<OutcomeOut>>& chosen) {
    chosen.assign(candidates.size(), {});
    for (size_t r = 0; r < candidates.size(); ++r) {
        const auto& outs = candidates[r];
        const size_t take = std::min(outs.size(), static_cast<size_t>(std::max(0, config.budget)));
        for (size_t i = 0; i < take; ++i)
            if (outs[i].probability >= config.min_probability && outs[i].probability > 0) chosen[r].push_back(outs[i]);
    }
    if (config.global_budget < 0) return;
    struct Entry {
        double p;
        int64_t key;
        int32_t row, i;
    };
    std::vector<Entry> pool;
    for (size_t r = 0; r < chosen.size(); ++r)
        for (size_t i = 0; i < chosen[r].size(); ++i)
            pool.push_back(Entry{chosen[r][i].probability, keys[r], static_cast<int32_t>(r), static_cast<int32_t>(i)});
    auto larger = [](const Entry& x, const Entry& y) {
        if (x.p != y.p) return x.p > y.p;
        if (x.key != y.key) return x.key > y.key;
        return x.i > y.i;
    };
    const size_t take = std::min(pool.size(), static_cast<size_t>(config.global_budget));
    std::partial_sort(pool.begin(), pool.begin() + take, pool.end(), larger);
    pool.resize(take);
    std::sort(pool.begin(), pool.end(), [](const Entry& x, const Entry& y) {
        return x.row != y.row ? x.row < y.row : x.i < y.i;
    });
    std::vector<std::vector<OutcomeOut>> kept(chosen.size());
    for (const Entry& e : pool) kept[e.row].push_back(chosen[e.row][e.i]);
    chosen.swap(kept);
}

}  // namespace ngramrl
