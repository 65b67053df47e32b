// Estimation: how a draft is read off the match states (the continuation estimate, the chain and
// its path choice) and how verification outcomes are predicted and chosen (the outcome model, the
// calibration, the allocator).
//
// These follow ngramrl/core/estimate.py, ngramrl/core/tree.py, NgramDrafter.chain and
// ngramrl/core/outcome.py line by line, with the same floating-point operations in the same
// order, so drafts, probabilities and outcomes are bit-identical to the reference. They only read an Automaton: when the reference
// algorithm changes (how continuations are estimated, path and length choice), this file is
// the one to follow it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

#include "automaton.hpp"

namespace ngramrl {

enum Source : int8_t { SOURCE_NONE = 0, SOURCE_PROMPT = 1, SOURCE_GLOBAL = 2 };

// std::stable_sort for the short lists of the planner's hot loop: libstdc++'s takes a temporary
// buffer from the heap on every call, however short the list; an insertion sort (stable too)
// needs none, and the few long lists still go to std::stable_sort.
template <typename It, typename Less>
inline void stable_sort_short(It first, It last, Less less) {
    if (last - first > 32) {
        std::stable_sort(first, last, less);
        return;
    }
    if (first == last) return;
    for (It i = first + 1; i != last; ++i) {
        auto value = std::move(*i);
        It j = i;
        for (; j != first && less(value, *(j - 1)); --j) *j = std::move(*(j - 1));
        *j = std::move(value);
    }
}

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

struct ChainConfig {
    int32_t min_match = 1;
    double min_confidence = 0.0;
    int32_t levels = 3;      // suffix levels per index the continuation estimate interpolates
    int32_t path_width = 1;  // root paths compared when choosing the chain (1: greedy)
    std::vector<int32_t> stop_tokens;

    bool is_stop(int32_t token) const {
        for (int32_t s : stop_tokens)
            if (s == token) return true;
        return false;
    }
};

struct SourceMatch {
    const Automaton* index;
    Match match;
};

// estimate.continuation_estimates: up to ``limit`` likeliest next tokens other than ``exclude``,
// as (probability, token), most likely first. Per source (the prompt's index first) the first
// ``levels`` suffix levels with continuations and at least ``min_length`` tokens are read,
// Witten-Bell interpolated; each level's ``limit`` most frequent continuations are the candidates,
// each scored exactly over every level read.
//
// The same sums in the same order as the reference, with fewer lookups: the counts a level's
// ranking read are reused, and since a token that continues a state in a suffix automaton also
// continues its suffix link, within one index the levels that know a candidate are the shortest
// ones read (each candidate's levels are scanned from the shortest until one does not know it).
class Estimator {
public:
    void estimate(const SourceMatch* sources, size_t num_sources, int32_t levels, int32_t limit, int32_t exclude,
                  int32_t min_length, double floor, std::vector<std::pair<double, int32_t>>& out) {
        read_.clear();
        candidates_.clear();
        entries_.clear();
        out.clear();
        source_begin_.resize(num_sources + 1);
        if (++stamp_ == 0) {  // the table's stamps wrapped: forget every entry
            for (Slot& slot : slots_) slot.stamp = 0;
            stamp_ = 1;
        }
        const size_t most = static_cast<size_t>(std::max(1, limit)) * static_cast<size_t>(std::max(1, levels)) *
                            std::max<size_t>(1, num_sources);
        if (slots_.size() < 2 * most) {
            size_t size = 16;
            while (size < 2 * most) size *= 2;
            slots_.assign(size, Slot{0, 0, 0});
            stamp_ = 1;
        }
        double mass = 1.0;
        for (size_t si = 0; si < num_sources; ++si) {
            source_begin_[si] = static_cast<int32_t>(read_.size());
            const Automaton& a = *sources[si].index;
            if (sources[si].match.matched < min_length) continue;
            int32_t state = sources[si].match.state;
            int32_t used = 0;
            while (used < levels && mass > floor && a[state].length >= min_length) {
                const Automaton::State& s = a[state];
                const int32_t distinct = a.num_children(state);
                if (distinct) {
                    used += 1;
                    int64_t norm = static_cast<int64_t>(s.followed) + distinct;
                    if (exclude >= 0) {
                        const int32_t rejected = a.child(state, exclude);
                        if (rejected >= 0) norm -= a[rejected].count;  // the level's estimate given "not exclude"
                    }
                    read_.push_back(
                        Level{state, static_cast<int32_t>(entries_.size()), 0, mass / static_cast<double>(norm), false});
                    if (limit == 1 && s.best_token != exclude) {
                        entries_.emplace_back(s.best_token, a[s.best_state].count);
                    } else {
                        a.ranked(state, static_cast<size_t>(limit) + 1, ranked_);
                        entries_.insert(entries_.end(), ranked_.begin(), ranked_.end());
                    }
                    read_.back().entries_end = static_cast<int32_t>(entries_.size());
                    read_.back().complete = read_.back().entries_end - read_.back().entries_begin == distinct;
                    mass *= static_cast<double>(distinct) / static_cast<double>(norm);
                }
                if (state == ROOT) break;
                state = s.link;
            }
        }
        source_begin_[num_sources] = static_cast<int32_t>(read_.size());
        const size_t num_levels = read_.size();
        add_candidates(exclude, limit, floor);
        // The counts the rankings read, per (candidate, level); -1: not read.
        known_.assign(candidates_.size() * num_levels, -1);
        for (size_t lv = 0; lv < num_levels; ++lv)
            for (int32_t e = read_[lv].entries_begin; e < read_[lv].entries_end; ++e) {
                const int32_t c = find(entries_[e].first);
                if (c >= 0) known_[static_cast<size_t>(c) * num_levels + lv] = entries_[e].second;
            }
        counts_.resize(num_levels);
        estimates_.clear();
        for (size_t c = 0; c < candidates_.size(); ++c) {
            const int32_t token = candidates_[c];
            const int32_t* known = known_.data() + c * num_levels;
            double p = 0.0;
            for (size_t si = 0; si < num_sources; ++si) {
                const Automaton& a = *sources[si].index;
                const int32_t begin = source_begin_[si], end = source_begin_[si + 1];
                int32_t first = end;
                for (int32_t lv = end - 1; lv >= begin; --lv) {
                    int32_t count = known[lv];
                    if (count < 0) {
                        if (read_[lv].complete) break;  // the ranking read every continuation: not one
                        const int32_t kid = a.child(read_[lv].state, token);
                        if (kid < 0) break;
                        count = a[kid].count;
                    }
                    counts_[lv] = count;
                    first = lv;
                }
                for (int32_t lv = first; lv < end; ++lv) p += read_[lv].scale * static_cast<double>(counts_[lv]);
            }
            // as in Python: the sum of the levels' shares can pass 1 by an ulp; an estimate is a probability
            estimates_.emplace_back(std::min(p, 1.0), token);
        }
        if (limit == 1) {  // the first of the largest
            int32_t top = -1;
            double top_p = floor;
            for (const auto& pt : estimates_)
                if (pt.first > top_p) {
                    top = pt.second;
                    top_p = pt.first;
                }
            if (top >= 0) out.emplace_back(top_p, top);
            return;
        }
        for (const auto& pt : estimates_)
            if (pt.first > floor) out.push_back(pt);
        stable_sort_short(out.begin(), out.end(),
                         [](const std::pair<double, int32_t>& x, const std::pair<double, int32_t>& y) {
                             return x.first > y.first;
                         });
        if (static_cast<int32_t>(out.size()) > limit) out.resize(limit);
    }

private:
    struct Level {
        int32_t state;
        int32_t entries_begin, entries_end;  // its ranking's (token, count) in entries_
        double scale;                        // the level's mass per occurrence
        bool complete;                       // the ranking holds every continuation
    };
    struct Slot {
        uint32_t stamp;
        int32_t token, candidate;
    };
    std::vector<Level> read_;
    std::vector<int32_t> source_begin_;
    std::vector<int32_t> candidates_;  // in the order first met (the reference's dict)
    std::vector<std::pair<int32_t, int32_t>> entries_, ranked_;
    std::vector<int32_t> known_, counts_;
    std::vector<int32_t> stops_;  // per level: where its candidates end (add_candidates)
    std::vector<Slot> slots_;  // token -> candidate, valid where stamp == stamp_
    uint32_t stamp_ = 0;
    std::vector<std::pair<double, int32_t>> estimates_;

    // Each level's ``limit`` most frequent continuations other than ``exclude`` are candidates,
    // level by level. With a ``floor``, a level's list stops at its first continuation whose
    // share of the estimate is at most floor / levels, where the shares of the first continuation
    // each level leaves out add up to at most ``floor``: a continuation left out has at each level
    // at most the count of the first one left out there (the rankings are by count), so its
    // estimate cannot pass the floor, and the output is the same.
    void add_candidates(int32_t exclude, int32_t limit, double floor) {
        const size_t num_levels = read_.size();
        stops_.assign(num_levels, 0);
        bool cut = false;
        if (floor > 0.0 && num_levels > 0) {
            const double share = floor / static_cast<double>(num_levels);
            double left_out = 0.0;
            for (size_t lv = 0; lv < num_levels; ++lv) {
                const Level& level = read_[lv];
                int32_t taken = 0, stop = level.entries_end;
                int64_t first_out = 0;  // the count of the first continuation not taken (0: none)
                for (int32_t e = level.entries_begin; e < level.entries_end; ++e) {
                    if (entries_[e].first == exclude) continue;
                    if (taken >= limit || level.scale * static_cast<double>(entries_[e].second) <= share) {
                        stop = e;
                        first_out = entries_[e].second;
                        break;
                    }
                    ++taken;
                }
                if (stop == level.entries_end && !level.complete)
                    first_out = entries_[level.entries_end - 1].second;  // the ranking did not list them all
                stops_[lv] = stop;
                left_out += level.scale * static_cast<double>(first_out);
            }
            cut = left_out * (1.0 + 1e-9) <= floor;
        }
        for (size_t lv = 0; lv < num_levels; ++lv) {
            const Level& level = read_[lv];
            const int32_t end = cut ? stops_[lv] : level.entries_end;
            int32_t taken = 0;
            for (int32_t e = level.entries_begin; e < end; ++e) {
                if (entries_[e].first == exclude) continue;
                if (taken++ >= limit) break;
                add(entries_[e].first);
            }
        }
    }

    int32_t find(int32_t token) const {
        const size_t mask = slots_.size() - 1;
        for (size_t at = (static_cast<uint32_t>(token) * 2654435761u) & mask;; at = (at + 1) & mask) {
            const Slot& slot = slots_[at];
            if (slot.stamp != stamp_) return -1;
            if (slot.token == token) return slot.candidate;
        }
    }

    void add(int32_t token) {
        const size_t mask = slots_.size() - 1;
        for (size_t at = (static_cast<uint32_t>(token) * 2654435761u) & mask;; at = (at + 1) & mask) {
            Slot& slot = slots_[at];
            if (slot.stamp != stamp_) {
                slot = Slot{stamp_, token, static_cast<int32_t>(candidates_.size())};
                candidates_.push_back(token);
                return;
            }
            if (slot.token == token) return;
        }
    }
};

inline void continuation_estimates(const SourceMatch* sources, size_t num_sources, int32_t levels, int32_t limit,
                                   int32_t exclude, int32_t min_length, double floor,
                                   std::vector<std::pair<double, int32_t>>& out) {
    thread_local Estimator estimator;
    estimator.estimate(sources, num_sources, levels, limit, exclude, min_length, floor, out);
}

// A walk down one match state's suffix links that an estimate is about to make, for cache hints.
struct LevelWalk {
    const Automaton* index;
    int32_t state;
    int32_t used;     // levels with continuations passed so far
    int32_t exclude;  // the token the estimate excludes (-1: none)
};

// Hints for the levels estimates read next (Estimator and GreedyStep read the first ``levels``
// suffix levels with continuations): every walk goes down its suffix links a level per round, so
// a level's record arrives while the other walks take their step, with the kid lists of the levels
// that have continuations. ``listed`` gets the levels whose kid list has its own record, for the
// caller's hints into the lists. The walks are consumed.
inline void hint_suffix_levels(std::vector<LevelWalk>& walks, int32_t levels, std::vector<LevelWalk>& listed) {
    listed.clear();
    for (const LevelWalk& w : walks) w.index->prefetch_state(w.state);
    while (!walks.empty()) {
        size_t kept = 0;
        for (LevelWalk w : walks) {
            const Automaton::State& state = (*w.index)[w.state];
            if (state.distinct) {
                ++w.used;
                w.index->prefetch_kids(state);
                if (state.kids >= 0) listed.push_back(w);
            }
            if (w.used >= levels || w.state == ROOT) continue;
            w.state = state.link;
            w.index->prefetch_state(w.state);
            walks[kept++] = w;
        }
        walks.resize(kept);
    }
}

inline void step_sources(std::vector<SourceMatch>& at, int32_t token) {
    for (SourceMatch& s : at) s.match = s.index->step(s.match, token);
}

// continuation_estimates with limit 1, no exclusion and no floor (the chain's greedy step), and
// the match states after the chosen token. Same levels, same candidates, the same floating-point
// sum in the same order; fewer lookups, because in a suffix automaton a token that continues a
// state continues its suffix link too: within one index the levels that know a candidate are the
// shortest ones read, so each candidate's levels are scanned from the shortest until one does not
// know it, and the longest that does is where Automaton::step would find it.
class GreedyStep {
public:
    // Whether there is a likeliest next token; then token(), probability() and advance().
    bool choose(const SourceMatch* sources, size_t num_sources, int32_t levels, int32_t min_length) {
        read_.clear();
        candidates_.clear();
        ranges_.resize(num_sources);
        double mass = 1.0;
        for (size_t si = 0; si < num_sources; ++si) {
            const Automaton& a = *sources[si].index;
            Range& range = ranges_[si];
            range.begin = range.end = static_cast<int32_t>(read_.size());
            range.first = -1;
            if (sources[si].match.matched < min_length) continue;
            int32_t state = sources[si].match.state;
            int32_t used = 0;
            while (used < levels && mass > 0.0 && a[state].length >= min_length) {
                const Automaton::State& s = a[state];
                const int32_t distinct = a.num_children(state);
                if (distinct) {
                    used += 1;
                    a.prefetch_kids(s);  // the best continuation's record and the kid list, read next
                    const int64_t norm = static_cast<int64_t>(s.followed) + distinct;
                    read_.push_back(Level{state, s.best_token, s.best_state, mass / static_cast<double>(norm)});
                    add(s.best_token);
                    mass *= static_cast<double>(distinct) / static_cast<double>(norm);
                }
                if (state == ROOT) break;
                state = s.link;
            }
            range.end = static_cast<int32_t>(read_.size());
        }
        // Each candidate's children first, their records' cache misses overlapped, then the sums.
        const size_t levels_read = read_.size(), num_candidates = candidates_.size();
        kids_.resize(num_candidates * levels_read);
        firsts_.resize(num_candidates * num_sources);
        for (size_t c = 0; c < num_candidates; ++c) {
            const int32_t token = candidates_[c];
            int32_t* kids = kids_.data() + c * levels_read;
            for (size_t si = 0; si < num_sources; ++si) {
                const Automaton& a = *sources[si].index;
                const Range& range = ranges_[si];
                int32_t first = range.end;
                for (int32_t lv = range.end - 1; lv >= range.begin; --lv) {
                    const Level& level = read_[lv];
                    const int32_t kid = level.best_token == token ? level.best_state : a.child(level.state, token);
                    if (kid < 0) break;
                    a.prefetch_state(kid);
                    kids[lv] = kid;
                    first = lv;
                }
                firsts_[c * num_sources + si] = first;
            }
        }
        token_ = -1;
        double top_p = 0.0;
        for (size_t c = 0; c < num_candidates; ++c) {
            const int32_t* kids = kids_.data() + c * levels_read;
            const int32_t* firsts = firsts_.data() + c * num_sources;
            double p = 0.0;
            for (size_t si = 0; si < num_sources; ++si) {
                const Automaton& a = *sources[si].index;
                for (int32_t lv = firsts[si]; lv < ranges_[si].end; ++lv)
                    p += read_[lv].scale * static_cast<double>(a[kids[lv]].count);
            }
            p = std::min(p, 1.0);  // continuation_estimates' bound
            if (p > top_p) {  // the first of the largest
                token_ = candidates_[c];
                top_p = p;
                for (size_t si = 0; si < num_sources; ++si) {
                    Range& range = ranges_[si];
                    range.first = firsts[si];
                    range.kid = firsts[si] < range.end ? kids[firsts[si]] : -1;
                }
            }
        }
        probability_ = top_p;
        return token_ >= 0;
    }

    int32_t token() const { return token_; }
    double probability() const { return probability_; }

    // Each source's match after the chosen token (Automaton::step, from what choose() found).
    void advance(SourceMatch* sources, size_t num_sources) const {
        for (size_t si = 0; si < num_sources; ++si) {
            SourceMatch& s = sources[si];
            const Range& range = ranges_[si];
            if (range.first < range.end) {
                const int32_t state = read_[range.first].state;
                const int32_t matched = state == s.match.state ? s.match.matched : (*s.index)[state].length;
                s.match = Match{range.kid, matched + 1};
            } else {
                s.match = s.index->step(s.match, token_);
            }
        }
    }

private:
    struct Level {
        int32_t state, best_token, best_state;
        double scale;  // the level's mass per occurrence
    };
    struct Range {
        int32_t begin, end;  // the source's levels in read_, longest first
        int32_t first;       // the chosen token's longest level in the source (end: none)
        int32_t kid;         // its child there
    };
    std::vector<Level> read_;
    std::vector<Range> ranges_;
    std::vector<int32_t> candidates_;  // in the order first met
    std::vector<int32_t> kids_;        // per candidate and level: its child (where it is known)
    std::vector<int32_t> firsts_;      // per candidate and source: its longest level there
    int32_t token_ = -1;
    double probability_ = 0.0;

    void add(int32_t token) {
        for (int32_t c : candidates_)
            if (c == token) return;
        candidates_.push_back(token);
    }
};

// One path of tree.extend_path: up to ``room`` more tokens, the likeliest each time, until a stop
// token, no evidence, or a path probability below min_confidence.
struct PathJob {
    std::vector<SourceMatch> at;  // the match states where the path is now
    double path_prob;
    int32_t room, added;
    std::vector<int32_t>* tokens;
    std::vector<double>* probs;
};

// The path's next token; whether the path goes on.
inline bool extend_once(PathJob& job, GreedyStep& greedy, const ChainConfig& config) {
    if (job.added >= job.room) return false;
    if (!greedy.choose(job.at.data(), job.at.size(), config.levels, config.min_match)) return false;
    const double p = greedy.probability();
    const int32_t token = greedy.token();
    job.path_prob *= p;
    if (job.path_prob < config.min_confidence) return false;
    job.tokens->push_back(token);
    job.probs->push_back(p);
    ++job.added;
    if (config.is_stop(token) || job.added >= job.room) return false;
    greedy.advance(job.at.data(), job.at.size());
    return true;
}

// Cache hints for the next token of several paths: the suffix levels their greedy steps read.
inline void prefetch_levels(const std::vector<PathJob>& jobs, const std::vector<int32_t>& active, int32_t levels) {
    thread_local std::vector<LevelWalk> walks, listed;
    walks.clear();
    for (int32_t j : active)
        for (const SourceMatch& s : jobs[j].at) walks.push_back(LevelWalk{s.index, s.match.state, 0, -1});
    hint_suffix_levels(walks, levels, listed);
    for (const LevelWalk& l : listed) l.index->prefetch_items((*l.index)[l.state]);
}

// Several paths at once, one token of each in turn (each path's tokens are what extend_path
// gives it alone): the rows of a batch overlap their cache misses.
inline void extend_paths(std::vector<PathJob>& jobs, const ChainConfig& config) {
    thread_local GreedyStep greedy;
    thread_local std::vector<int32_t> active;
    active.clear();
    for (size_t j = 0; j < jobs.size(); ++j)
        if (jobs[j].room > 0) active.push_back(static_cast<int32_t>(j));
    while (!active.empty()) {
        if (active.size() > 1) prefetch_levels(jobs, active, config.levels);
        size_t kept = 0;
        for (int32_t j : active)
            if (extend_once(jobs[j], greedy, config)) active[kept++] = j;
        active.resize(kept);
    }
}

inline void extend_path(const std::vector<SourceMatch>& start, double path_prob, int32_t room,
                        const ChainConfig& config, std::vector<int32_t>& tokens, std::vector<double>& probs) {
    thread_local GreedyStep greedy;
    thread_local PathJob job;
    job.at.assign(start.begin(), start.end());
    job.path_prob = path_prob;
    job.room = room;
    job.added = 0;
    job.tokens = &tokens;
    job.probs = &probs;
    while (extend_once(job, greedy, config)) {
    }
}

// tree.DraftTree as the chain's path choice needs it, and each node's match states.
struct TreeOut {
    std::vector<int32_t> tokens, parents;
    std::vector<double> probs, path_probs;
    std::vector<std::vector<SourceMatch>> node_sources;
};

constexpr int32_t ROOT_NODE = -1;

// tree.grow_tree: the best-first tree of at most ``size`` nodes and ``width`` root-to-leaf paths.
inline void grow_tree(const std::vector<SourceMatch>& sources, int32_t size, int32_t width, const ChainConfig& config,
                      TreeOut& tree) {
    tree = TreeOut{};
    if (size <= 0 || width <= 0) return;
    struct Candidate {
        double path_prob;
        int64_t order;
        int32_t parent, token;
        double p;
    };
    // heapq over (-path probability, order): the largest path probability, then the first proposed.
    auto after = [](const Candidate& x, const Candidate& y) {
        return x.path_prob != y.path_prob ? x.path_prob < y.path_prob : x.order > y.order;
    };
    std::vector<Candidate> heap;
    int64_t proposed = 0;
    std::vector<std::pair<double, int32_t>> estimates;
    auto propose = [&](int32_t parent, const std::vector<SourceMatch>& at, double path_prob, int32_t limit) {
        continuation_estimates(at.data(), at.size(), config.levels, limit, -1, config.min_match, 0.0, estimates);
        for (const auto& pt : estimates) {
            heap.push_back(Candidate{path_prob * pt.first, proposed++, parent, pt.second, pt.first});
            std::push_heap(heap.begin(), heap.end(), after);
        }
    };
    propose(ROOT_NODE, sources, 1.0, width);
    std::vector<bool> has_children;
    bool root_has_children = false;
    int32_t leaves = 0;
    while (!heap.empty() && static_cast<int32_t>(tree.tokens.size()) < size) {
        std::pop_heap(heap.begin(), heap.end(), after);
        const Candidate c = heap.back();
        heap.pop_back();
        if (c.path_prob < config.min_confidence) break;
        const bool branches = c.parent == ROOT_NODE ? root_has_children : static_cast<bool>(has_children[c.parent]);
        if (branches || c.parent == ROOT_NODE) {  // a new root-to-leaf path
            if (leaves >= width) continue;
            leaves += 1;
        }
        if (c.parent == ROOT_NODE)
            root_has_children = true;
        else
            has_children[c.parent] = true;
        const int32_t node = static_cast<int32_t>(tree.tokens.size());
        tree.tokens.push_back(c.token);
        tree.parents.push_back(c.parent);
        tree.probs.push_back(c.p);
        tree.path_probs.push_back(c.path_prob);
        has_children.push_back(false);
        std::vector<SourceMatch> at = c.parent == ROOT_NODE ? sources : tree.node_sources[c.parent];
        step_sources(at, c.token);
        tree.node_sources.push_back(std::move(at));
        if (!config.is_stop(c.token) && static_cast<int32_t>(tree.tokens.size()) < size)
            propose(node, tree.node_sources[node], c.path_prob, leaves < width ? width : 1);
    }
}

// tree.choose_path: the root path of the largest sum of path probabilities, ties to the leaf added first.
inline void choose_path(const TreeOut& tree, std::vector<int32_t>& best) {
    best.clear();
    const size_t n = tree.tokens.size();
    std::vector<bool> inner(n, false);
    for (int32_t parent : tree.parents)
        if (parent != ROOT_NODE) inner[parent] = true;
    double best_value = -1.0;
    std::vector<int32_t> path;
    for (size_t leaf = 0; leaf < n; ++leaf) {
        if (inner[leaf]) continue;
        path.clear();
        for (int32_t node = static_cast<int32_t>(leaf); node != ROOT_NODE; node = tree.parents[node]) path.push_back(node);
        std::reverse(path.begin(), path.end());
        double value = 0.0;
        for (int32_t i : path) value = value + tree.path_probs[i];
        if (value > best_value) {
            best = path;
            best_value = value;
        }
    }
}

// NgramDrafter._source_of: the prompt's index when it saw ``token`` after one of the levels read.
inline int8_t source_of(const SourceMatch& prompt, int32_t token, const ChainConfig& config) {
    const Automaton& a = *prompt.index;
    if (prompt.match.matched < config.min_match) return SOURCE_GLOBAL;
    int32_t state = prompt.match.state, used = 0;
    while (state >= 0 && used < config.levels && a[state].length >= config.min_match) {
        if (a.num_children(state)) {
            used += 1;
            if (a.child(state, token) >= 0) return SOURCE_PROMPT;
        }
        state = a[state].link;
    }
    return SOURCE_GLOBAL;
}

// NgramDrafter.chain: the chain draft from the context's match states (the prompt's index first).
inline void chain(const std::vector<SourceMatch>& sources, int32_t k, const ChainConfig& config, DraftOut& out) {
    out.clear();
    out.matched = sources[0].match.matched;
    if (config.path_width == 1) {  // the tree of width 1, without the tree's bookkeeping
        extend_path(sources, 1.0, k, config, out.tokens, out.probs);
    } else {
        thread_local TreeOut tree;
        thread_local std::vector<int32_t> path;
        grow_tree(sources, k, config.path_width, config, tree);
        choose_path(tree, path);
        if (path.empty()) return;
        for (int32_t i : path) {
            out.tokens.push_back(tree.tokens[i]);
            out.probs.push_back(tree.probs[i]);
        }
        if (static_cast<int32_t>(out.tokens.size()) < k && !config.is_stop(out.tokens.back()))
            extend_path(tree.node_sources[path.back()], tree.path_probs[path.back()],
                        k - static_cast<int32_t>(out.tokens.size()), config, out.tokens, out.probs);
    }
    if (!out.tokens.empty()) out.source = source_of(sources[0], out.tokens[0], config);
}

// chain for several drafts at once (the same drafts as chain for each).
inline void chains(const std::vector<std::vector<SourceMatch>>& sources, const int32_t* ks, DraftOut* const* outs,
                   size_t n, const ChainConfig& config) {
    if (config.path_width != 1) {
        for (size_t i = 0; i < n; ++i) chain(sources[i], ks[i], config, *outs[i]);
        return;
    }
    thread_local std::vector<PathJob> jobs;
    jobs.resize(n);
    for (size_t i = 0; i < n; ++i) {
        DraftOut& out = *outs[i];
        out.clear();
        out.tokens.reserve(ks[i]);  // one allocation each, not one per doubling as tokens are added
        out.probs.reserve(ks[i]);
        out.matched = ks[i] > 0 ? sources[i][0].match.matched : 0;  // no draft: the reference's EMPTY
        PathJob& job = jobs[i];
        job.at.assign(sources[i].begin(), sources[i].end());
        job.path_prob = 1.0;
        job.room = ks[i];
        job.added = 0;
        job.tokens = &out.tokens;
        job.probs = &out.probs;
    }
    extend_paths(jobs, config);
    for (size_t i = 0; i < n; ++i) {
        DraftOut& out = *outs[i];
        if (!out.tokens.empty()) out.source = source_of(sources[i][0], out.tokens[0], config);
    }
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

// One row's outcome.predict_outcomes: its sources (the prompt's index first), its draft and the
// calibrated acceptance chance of each draft token; ``out`` gets the ``limit`` most probable
// (j, b), most probable first, and ``walked`` (optional, one per source) the match states after
// tokens[:j] for each j the prediction read.
struct OutcomeQuery {
    const SourceMatch* sources;
    size_t num_sources;
    const int32_t* tokens;
    int32_t k;
    const double* chances;
    std::vector<OutcomeOut>* out;
    std::vector<Match>* const* walked = nullptr;
};

// outcome.predict_outcomes for several rows at once, each computed exactly as alone. After a
// forward a row's prediction is a chain of dependent cache misses (match states, suffix links,
// kid lists); the rows go in lock step, one j each per round, and before a round's estimates
// every row's next reads are hinted a level at a time, so different rows' misses overlap.
class OutcomePlanner {
public:
    void predict(const OutcomeQuery* queries, size_t n, int32_t limit, int32_t levels, double floor) {
        rows_.resize(n);
        for (size_t r = 0; r < n; ++r) start(rows_[r], queries[r], limit);
        auto heap_greater = [](const OutcomeOut& x, const OutcomeOut& y) { return outcome_less(y, x); };  // min-heap
        for (;;) {
            active_.clear();
            for (size_t r = 0; r < n; ++r)
                if (next_j(rows_[r], queries[r], limit, floor)) active_.push_back(r);
            if (active_.empty()) break;
            extend_chains(queries);
            hint_levels(queries, levels);
            for (size_t r : active_) {
                Row& row = rows_[r];
                const OutcomeQuery& q = queries[r];
                std::vector<OutcomeOut>& out = *q.out;
                const int32_t j = row.j;
                const double pj = row.p_accepted[j];
                for (size_t s = 0; s < q.num_sources; ++s) at_j_[s] = SourceMatch{q.sources[s].index, row.chains[s][j]};
                const double bar = std::max(static_cast<int32_t>(out.size()) == limit ? out.front().probability : 0.0, floor);
                continuation_estimates(at_j_, q.num_sources, levels, limit, j < q.k ? q.tokens[j] : -1, 0,
                                       bar > 0.0 ? bar / pj : 0.0, dist_);
                for (const auto& pt : dist_) {
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
        }
        for (size_t r = 0; r < n; ++r) {
            const OutcomeQuery& q = queries[r];
            std::sort(q.out->begin(), q.out->end(), [](const OutcomeOut& x, const OutcomeOut& y) { return outcome_less(y, x); });
            if (q.walked)
                for (size_t s = 0; s < q.num_sources; ++s) q.walked[s]->assign(rows_[r].chains[s].begin(), rows_[r].chains[s].end());
        }
    }

private:
    static constexpr size_t kMaxSources = 2;
    struct Row {
        std::vector<double> p_accepted;
        std::vector<int32_t> order;  // the j, likeliest first
        size_t next = 0;             // into order
        int32_t j = -1;
        bool done = false;
        std::vector<Match> chains[kMaxSources];
    };
    std::vector<Row> rows_;
    std::vector<size_t> active_;
    std::vector<LevelWalk> walks_, listed_;
    SourceMatch at_j_[kMaxSources];
    std::vector<std::pair<double, int32_t>> dist_;

    static void start(Row& row, const OutcomeQuery& q, int32_t limit) {
        q.out->clear();
        if (q.walked)
            for (size_t s = 0; s < q.num_sources; ++s) q.walked[s]->clear();
        row.done = limit <= 0 || q.num_sources == 0;
        row.next = 0;
        for (auto& chain : row.chains) chain.clear();
        if (row.done) return;
        if (q.num_sources > kMaxSources) throw std::logic_error("predict_outcomes reads at most two sources");
        row.p_accepted.clear();
        double survive = 1.0;
        for (int32_t i = 0; i < q.k; ++i) {
            row.p_accepted.push_back(survive * (1.0 - q.chances[i]));
            survive *= q.chances[i];
        }
        row.p_accepted.push_back(survive);
        row.order.resize(q.k + 1);
        for (int32_t j = 0; j <= q.k; ++j) row.order[j] = j;
        const std::vector<double>& p = row.p_accepted;
        stable_sort_short(row.order.begin(), row.order.end(), [&p](int32_t x, int32_t y) { return p[x] > p[y]; });
        for (size_t s = 0; s < q.num_sources; ++s) row.chains[s].push_back(q.sources[s].match);
    }

    // The row's next j, or false once no later j can enter its top ``limit`` (P(b | j) <= 1) or
    // pass ``floor``.
    static bool next_j(Row& row, const OutcomeQuery& q, int32_t limit, double floor) {
        if (row.done) return false;
        if (row.next == row.order.size()) {
            row.done = true;
            return false;
        }
        row.j = row.order[row.next++];
        const std::vector<OutcomeOut>& out = *q.out;
        const double pj = row.p_accepted[row.j];
        if ((static_cast<int32_t>(out.size()) == limit && pj <= out.front().probability) || (floor > 0.0 && pj <= floor)) {
            row.done = true;
            return false;
        }
        return true;
    }

    // The active rows' match states after tokens[:j], a token of every row per round.
    void extend_chains(const OutcomeQuery* queries) {
        for (bool more = true; more;) {
            more = false;
            for (size_t r : active_) {  // the records the steps read, hinted first
                const OutcomeQuery& q = queries[r];
                for (size_t s = 0; s < q.num_sources; ++s)
                    if (static_cast<int32_t>(rows_[r].chains[s].size()) <= rows_[r].j)
                        q.sources[s].index->prefetch_kids((*q.sources[s].index)[rows_[r].chains[s].back().state]);
            }
            for (size_t r : active_) {
                const OutcomeQuery& q = queries[r];
                for (size_t s = 0; s < q.num_sources; ++s) {
                    std::vector<Match>& chain = rows_[r].chains[s];
                    if (static_cast<int32_t>(chain.size()) > rows_[r].j) continue;
                    const Automaton& a = *q.sources[s].index;
                    chain.push_back(a.step(chain.back(), q.tokens[chain.size() - 1]));
                    a.prefetch_state(chain.back().state);
                    more = more || static_cast<int32_t>(chain.size()) <= rows_[r].j;
                }
            }
        }
    }

    // Hints for what the active rows' estimates read: their suffix levels, then in the kid lists
    // where the excluded token is looked up, and a short list's items (it is ranked from them),
    // then the records those lead to.
    void hint_levels(const OutcomeQuery* queries, int32_t levels) {
        walks_.clear();
        for (size_t r : active_) {
            const OutcomeQuery& q = queries[r];
            for (size_t s = 0; s < q.num_sources; ++s)
                walks_.push_back(LevelWalk{q.sources[s].index, rows_[r].chains[s][rows_[r].j].state, 0,
                                           rows_[r].j < q.k ? q.tokens[rows_[r].j] : -1});
        }
        hint_suffix_levels(walks_, levels, listed_);
        for (const LevelWalk& l : listed_) l.index->prefetch_lookup((*l.index)[l.state], l.exclude);
        for (const LevelWalk& l : listed_) {
            const Automaton::State& state = (*l.index)[l.state];
            if (static_cast<size_t>(state.distinct) < Automaton::kRankCacheFrom) l.index->prefetch_children(state);
            if (l.exclude >= 0) {
                const int32_t kid = l.index->child(l.state, l.exclude);
                if (kid >= 0) l.index->prefetch_state(kid);
            }
        }
    }
};

// outcome.AcceptanceCalibration: acceptance per (position bucket, estimate decile).
class Calibration {
public:
    static constexpr int kBuckets = 6, kDeciles = 10;

    Calibration(double prior_strength, double decay) : prior_strength_(prior_strength), decay_(decay) {}

    static int bucket(int position) { return position < 4 ? position : position < 8 ? 4 : 5; }
    // (estimates are probabilities, checked where they enter the core)
    static int decile(double estimate) { return std::clamp(static_cast<int>(estimate * 10), 0, 9); }

    double chance(int position, double estimate) const {
        const int b = bucket(position), d = decile(estimate);
        const Cell& cell = cells_[b][d];
        if (!cell.seen) return estimate;
        return (cell.accepted + prior_strength_ * estimate) / (cell.trials + prior_strength_);
    }

    // The cell a draft token's estimate at ``position`` falls in (bucket * kDeciles + decile).
    static uint8_t cell_of(int position, double estimate) {
        return static_cast<uint8_t>(bucket(position) * kDeciles + decile(estimate));
    }

    // A draft of n tokens with estimates ``probs`` of which ``accepted`` were accepted.
    void observe(const double* probs, int n, int accepted) {
        const int upto = std::min(n, accepted + 1);
        for (int position = 0; position < upto; ++position) observe_cell(cell_of(position, probs[position]), position < accepted);
    }

    // The same for a draft whose first ``upto`` tokens' cells were found already (cell_of).
    void observe_cells(const uint8_t* cells, int upto, int accepted) {
        for (int position = 0; position < upto; ++position) observe_cell(cells[position], position < accepted);
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
    void observe_cell(uint8_t code, bool accepted) {
        const int b = code / kDeciles, d = code % kDeciles;
        Cell& cell = cells_[b][d];
        if (!cell.seen) {
            cell.seen = true;
            order_.emplace_back(b, d);
        }
        cell.accepted = decay_ * cell.accepted + (accepted ? 1 : 0);
        cell.trials = decay_ * cell.trials + 1;
    }

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
// tokens the unscaled chances expect of what is kept (the proposer's _lengths). ``fit``: the
// step-cost model's StepCostModel.fit (base, per request, per token past the plateau, per
// verifying step, the plateau's knee in tokens).
struct LengthChoice {
    std::vector<int32_t> lengths;
    double expected = 0.0;
    bool paid = false;    // the cost model (not a probe) kept a token
    bool probed = false;  // a probe chose the lengths
};

inline void choose_lengths(const Calibration& calibration, const double* probs, const int64_t* offsets, size_t rows,
                           double scale, const double fit[5], double min_gain, bool adaptive,
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
        const double base = fit[0], per_request = fit[1], per_token = fit[2], per_verify = fit[3];
        const int64_t knee = static_cast<int64_t>(fit[4]);
        const double demand = 1.0 + min_gain;
        if (per_token <= 0.0 && per_verify <= 0.0) {
            for (size_t r = 0; r < rows; ++r) out.lengths[r] = static_cast<int32_t>(offsets[r + 1] - offsets[r]);
        } else {
            const double plain = static_cast<double>(rows);
            const double plain_time = base + per_request * static_cast<double>(rows);
            const int64_t free = std::max<int64_t>(0, knee - static_cast<int64_t>(rows));  // inside the plateau
            double committed = plain, time = plain_time + per_verify;
            int64_t taken = 0;
            best_first(scaled, [&](const Next& n) {
                const double cost = taken >= free ? per_token : 0.0;
                if (n.s * time <= demand * cost * committed) return false;
                out.lengths[n.r] = static_cast<int32_t>(n.i) + 1;
                committed += n.s;
                time += cost;
                ++taken;
                return true;
            });
            // The whole set pays for verifying at all with its expected tokens taken at 1 / demand
            // and its added time at demand times the fit's.
            if ((plain + (committed - plain) / demand) * plain_time <= plain * (plain_time + demand * (time - plain_time)))
                out.lengths.assign(rows, 0);
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
// across rows as the reference's dictionary keys do (the request handles). With a budget across
// the batch the outcomes kept are those not below the budget-th largest (probability, key,
// position) (a strict order: the same set as the reference's heap), found in linear time, and
// each row keeps its own in their order.
inline void allocate(const std::vector<std::vector<OutcomeOut>>& candidates, const std::vector<int64_t>& keys,
                     const AllocateConfig& config, std::vector<std::vector<OutcomeOut>>& chosen) {
    chosen.resize(candidates.size());
    size_t eligible = 0;
    for (size_t r = 0; r < candidates.size(); ++r) {
        const auto& outs = candidates[r];
        chosen[r].clear();
        const size_t take = std::min(outs.size(), static_cast<size_t>(std::max(0, config.budget)));
        for (size_t i = 0; i < take; ++i)
            if (outs[i].probability >= config.min_probability && outs[i].probability > 0) chosen[r].push_back(outs[i]);
        eligible += chosen[r].size();
    }
    if (config.global_budget < 0 || eligible <= static_cast<size_t>(config.global_budget)) return;
    struct Entry {
        double p;
        int64_t key;
        int32_t i;
    };
    auto larger = [](const Entry& x, const Entry& y) {
        if (x.p != y.p) return x.p > y.p;
        if (x.key != y.key) return x.key > y.key;
        return x.i > y.i;
    };
    const size_t take = static_cast<size_t>(config.global_budget);
    if (take == 0) {
        for (auto& row : chosen) row.clear();
        return;
    }
    thread_local std::vector<Entry> pool;
    pool.clear();
    pool.reserve(eligible);
    for (size_t r = 0; r < chosen.size(); ++r)
        for (size_t i = 0; i < chosen[r].size(); ++i)
            pool.push_back(Entry{chosen[r][i].probability, keys[r], static_cast<int32_t>(i)});
    std::nth_element(pool.begin(), pool.begin() + static_cast<std::ptrdiff_t>(take - 1), pool.end(), larger);
    const Entry cutoff = pool[take - 1];
    for (size_t r = 0; r < chosen.size(); ++r) {
        std::vector<OutcomeOut>& row = chosen[r];
        size_t kept = 0;
        for (size_t i = 0; i < row.size(); ++i)
            if (!larger(cutoff, Entry{row[i].probability, keys[r], static_cast<int32_t>(i)})) row[kept++] = row[i];
        row.resize(kept);
    }
}

// outcome.budget_cut: the least likely outcome chosen where the batch's budget was spent in full,
// else 0.
inline double budget_cut(const std::vector<std::vector<OutcomeOut>>& chosen, int64_t global_budget) {
    int64_t count = 0;
    double least = 0.0;
    for (const auto& row : chosen)
        for (const OutcomeOut& o : row) {
            least = count == 0 ? o.probability : std::min(least, o.probability);
            ++count;
        }
    return global_budget > 0 && count >= global_budget ? least : 0.0;
}

}  // namespace ngramrl
