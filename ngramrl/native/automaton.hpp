// The generalized suffix automaton of ngramrl/core/automaton.py, in a flat layout.
//
// Same states, same transitions, same counts and the same "most frequent continuation, newest
// on ties" as the reference: the construction below follows SuffixAutomaton.extend step by step
// (including the order children are first added, which decides ties when ranking them).
//
// Layout: one 32-byte record per state. A state with at most one continuation keeps it in
// best_token/best_state only (most states); a state with two or more gets a KidList: its
// (token, target) pairs in insertion order, with a hash index once it has many.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace ngramrl {

constexpr int32_t ROOT = 0;
constexpr int32_t NO_TOKEN = -1;

struct Match {
    int32_t state = ROOT;
    int32_t matched = 0;
    bool operator==(const Match& o) const { return state == o.state && matched == o.matched; }
};

inline uint64_t next_serial() {
    static std::atomic<uint64_t> serial{0};
    return ++serial;
}

class Automaton {
public:
    // Half a cache line, aligned: one miss reads a state, and the estimate's walk down the suffix
    // links learns how many continuations each level has without reading its kid list.
    struct alignas(32) State {
        int32_t link;
        int32_t length;
        int32_t count;       // size of the end-position set
        int32_t followed;    // occurrences that some token followed
        int32_t best_token;  // most frequent continuation (newest on ties)
        int32_t best_state;
        int32_t kids;        // index into kids_, or -1: at most one continuation (in best_*)
        int32_t distinct;    // number of distinct continuations
    };
    static_assert(sizeof(State) == 32, "a state record is half a cache line");

    struct KidList {
        std::vector<std::pair<int32_t, int32_t>> items;  // (token, target), insertion order
        std::vector<int32_t> where;  // open addressing, token -> position + 1 (0: empty), once large
        // The ranking's head for a state with many continuations, read by the outcome model;
        // valid while top_stamp is the state's followed (extend keeps it so: keep_ranking).
        std::vector<std::pair<int32_t, int32_t>> top;
        int32_t top_stamp = -1;
    };

    static constexpr size_t kHashFrom = 12;

    static size_t slot_of(int32_t token, size_t mask) { return (static_cast<uint32_t>(token) * 2654435761u) & mask; }

    // Position of ``token`` in a KidList's items, or -1.
    static int32_t position(const KidList& kl, int32_t token) {
        if (!kl.where.empty()) {
            const size_t mask = kl.where.size() - 1;
            for (size_t at = slot_of(token, mask);; at = (at + 1) & mask) {
                const int32_t p = kl.where[at];
                if (p == 0) return -1;
                if (kl.items[p - 1].first == token) return p - 1;
            }
        }
        for (size_t i = 0; i < kl.items.size(); ++i)
            if (kl.items[i].first == token) return static_cast<int32_t>(i);
        return -1;
    }

    static void index_kids(KidList& kl) {
        size_t size = 32;
        while (size < 2 * kl.items.size()) size *= 2;
        kl.where.assign(size, 0);
        const size_t mask = size - 1;
        for (size_t i = 0; i < kl.items.size(); ++i) {
            size_t at = slot_of(kl.items[i].first, mask);
            while (kl.where[at] != 0) at = (at + 1) & mask;
            kl.where[at] = static_cast<int32_t>(i) + 1;
        }
    }
    static constexpr size_t kRankCacheFrom = 8;
    static constexpr size_t kRankCacheSize = 24;  // entries cached: the outcome model reads budget + 1

    const uint64_t serial;
    int64_t num_tokens = 0;
    int64_t num_sequences = 0;

    Automaton() : serial(next_serial()) { states_.push_back(State{-1, 0, 0, 0, NO_TOKEN, -1, -1, 0}); }
    Automaton(const Automaton&) = delete;
    Automaton& operator=(const Automaton&) = delete;

    int32_t num_states() const { return static_cast<int32_t>(states_.size()); }
    const State& operator[](int32_t s) const { return states_[s]; }
    // Python's length[-1] is the last state's length; the walk can read length[link[ROOT]].
    int32_t length_at(int32_t s) const { return s >= 0 ? states_[s].length : states_.back().length; }

    // Hints for the cache (no effect on results): a state's record, and the kid lists and child
    // records the estimate reads next from a state whose record is in the cache.
    void prefetch_state(int32_t s) const {
        __builtin_prefetch(&states_[s]);
    }
    void prefetch_kids(const State& s) const {
        if (s.best_state >= 0) prefetch_state(s.best_state);
        if (s.kids >= 0) __builtin_prefetch(&kids_[s.kids]);
    }
    // Where child(state, token) reads in the kid list of a state whose list record is cached: the
    // token's hash slot (a long list's) and the start of the items.
    void prefetch_lookup(const State& s, int32_t token) const {
        if (s.kids < 0) return;
        const KidList& kl = kids_[s.kids];
        if (!kl.where.empty()) __builtin_prefetch(&kl.where[slot_of(token, kl.where.size() - 1)]);
        __builtin_prefetch(kl.items.data());
    }
    // The records of a short kid list's children (a ranking reads their counts).
    void prefetch_children(const State& s) const {
        if (s.kids < 0) return;
        for (const auto& item : kids_[s.kids].items) prefetch_state(item.second);
    }
    void prefetch_items(const State& s) const {
        if (s.kids >= 0) __builtin_prefetch(kids_[s.kids].items.data());
    }

    int32_t child(int32_t state, int32_t token) const {
        const State& s = states_[state];
        if (s.kids < 0) return s.best_token == token ? s.best_state : -1;
        const KidList& kl = kids_[s.kids];
        const int32_t at = position(kl, token);
        return at < 0 ? -1 : kl.items[at].second;
    }

    // Number of distinct continuations.
    int32_t num_children(int32_t state) const { return states_[state].distinct; }

    int32_t new_sequence() {
        ++num_sequences;
        return ROOT;
    }

    int32_t add_sequence(const int32_t* tokens, size_t n) {
        int32_t cursor = new_sequence();
        for (size_t i = 0; i < n; ++i) cursor = extend(cursor, tokens[i]);
        return cursor;
    }

    int32_t add_sequence(const std::vector<int32_t>& tokens) { return add_sequence(tokens.data(), tokens.size()); }

    int32_t extend(int32_t last, int32_t token) {
        int32_t cur;
        int32_t q = child(last, token);
        if (q >= 0) {
            if (states_[q].length == states_[last].length + 1) {
                cur = q;
            } else {
                cur = clone(q, states_[last].length + 1);
                redirect(last, token, q, cur);
                states_[q].link = cur;
            }
        } else {
            cur = new_state(states_[last].length + 1, ROOT);
            int32_t p = last;
            while (p != -1 && child(p, token) < 0) {
                set_child(p, token, cur);
                p = states_[p].link;
            }
            if (p != -1) {
                q = child(p, token);
                if (states_[p].length + 1 == states_[q].length) {
                    states_[cur].link = q;
                } else {
                    int32_t c = clone(q, states_[p].length + 1);
                    redirect(p, token, q, c);
                    states_[q].link = c;
                    states_[cur].link = c;
                }
            }
        }
        for (int32_t v = cur; v > ROOT; v = states_[v].link) states_[v].count += 1;
        for (int32_t p = last; p != -1; p = states_[p].link) {
            State& s = states_[p];
            s.followed += 1;
            if (s.kids >= 0) {
                int32_t target = child(p, token);
                int32_t best = s.best_state;
                const int32_t was_best = s.best_token;
                if (best < 0 || states_[target].count >= states_[best].count) {
                    s.best_token = token;
                    s.best_state = target;
                }
                KidList& kl = kids_[s.kids];
                if (kl.top_stamp == s.followed - 1)
                    keep_ranking(kl, token, states_[target].count, was_best, s.best_token, s.followed);
            }
        }
        ++num_tokens;
        return cur;
    }

    // Extend a match by one token: the longest suffix that stays known.
    Match step(Match m, int32_t token) const {
        int32_t state = m.state, matched = m.matched;
        int32_t target = child(state, token);
        while (target < 0 && state != ROOT) {
            state = states_[state].link;
            matched = states_[state].length;
            target = child(state, token);
        }
        if (target < 0) return Match{ROOT, 0};
        return Match{target, matched + 1};
    }

    Match advance(Match m, const int32_t* tokens, size_t n) const {
        for (size_t i = 0; i < n; ++i) m = step(m, tokens[i]);
        return m;
    }

    // The first ``m`` continuations of a state in SuffixAutomaton.continuations' order (count, then
    // the best continuation, then token id), and how many there are in all.
    int32_t ranked(int32_t state, size_t m, std::vector<std::pair<int32_t, int32_t>>& out) const {
        out.clear();
        const State& s = states_[state];
        if (s.kids < 0) {
            if (s.best_token >= 0 && m > 0) out.emplace_back(s.best_token, states_[s.best_state].count);
            return s.best_token < 0 ? 0 : 1;
        }
        const KidList& kl = kids_[s.kids];
        const int32_t total = static_cast<int32_t>(kl.items.size());
        if (kl.items.size() >= kRankCacheFrom) {
            std::lock_guard<std::mutex> lock(rank_mutex_);
            KidList& cache = const_cast<KidList&>(kl);
            if (cache.top_stamp != s.followed || cache.top.size() < std::min(m, kl.items.size())) {
                rank_into(kl, s.best_token, std::max(m, kRankCacheSize), cache.top);
                cache.top_stamp = s.followed;
            }
            out.assign(cache.top.begin(), cache.top.begin() + std::min(m, cache.top.size()));
            return total;
        }
        rank_into(kl, s.best_token, m, out);
        return total;
    }

    size_t memory_bytes() const {
        constexpr size_t kHeap = 16;  // malloc's bookkeeping per allocation (glibc, 64-bit)
        size_t bytes = sizeof(*this) + states_.capacity() * sizeof(State) + kids_.capacity() * sizeof(KidList);
        for (const auto& kl : kids_) {
            bytes += kl.items.capacity() * sizeof(kl.items[0]) + (kl.items.capacity() ? kHeap : 0);
            bytes += kl.top.capacity() * sizeof(kl.top[0]) + (kl.top.capacity() ? kHeap : 0);
            bytes += kl.where.capacity() * sizeof(int32_t) + (kl.where.capacity() ? kHeap : 0);
        }
        return bytes;
    }

    void shrink() {
        states_.shrink_to_fit();
        kids_.shrink_to_fit();
    }

    void reserve(size_t tokens) { states_.reserve(states_.size() + 2 * tokens); }

private:
    std::vector<State> states_;
    std::vector<KidList> kids_;
    mutable std::mutex rank_mutex_;

    int32_t new_state(int32_t length, int32_t link) {
        states_.push_back(State{link, length, 0, 0, NO_TOKEN, -1, -1, 0});
        return static_cast<int32_t>(states_.size()) - 1;
    }

    int32_t clone(int32_t q, int32_t length) {
        int32_t c = new_state(length, states_[q].link);
        const State src = states_[q];
        State& dst = states_[c];
        dst.count = src.count;
        dst.best_token = src.best_token;
        dst.best_state = src.best_state;
        dst.followed = src.followed;
        dst.distinct = src.distinct;
        if (src.kids >= 0) {
            KidList copy;
            copy.items = kids_[src.kids].items;
            copy.where = kids_[src.kids].where;
            kids_.push_back(std::move(copy));
            states_[c].kids = static_cast<int32_t>(kids_.size()) - 1;
        }
        return c;
    }

    void redirect(int32_t p, int32_t token, int32_t q, int32_t c) {
        while (p != -1 && child(p, token) == q) {
            set_child(p, token, c);
            p = states_[p].link;
        }
    }

    void set_child(int32_t state, int32_t token, int32_t target) {
        State& s = states_[state];
        if (s.kids >= 0) {
            KidList& kl = kids_[s.kids];
            const int32_t at = position(kl, token);
            if (at >= 0) {
                kl.items[at].second = target;
            } else {
                kl.items.emplace_back(token, target);
                s.distinct += 1;
                if (!kl.where.empty() && 2 * kl.items.size() <= kl.where.size()) {
                    const size_t mask = kl.where.size() - 1;
                    size_t slot = slot_of(token, mask);
                    while (kl.where[slot] != 0) slot = (slot + 1) & mask;
                    kl.where[slot] = static_cast<int32_t>(kl.items.size());
                } else if (kl.items.size() > kHashFrom) {
                    index_kids(kl);
                }
            }
            if (s.best_token == token) s.best_state = target;
        } else if (s.best_token < 0) {
            s.best_token = token;
            s.best_state = target;
            s.distinct = 1;
        } else if (s.best_token == token) {
            s.best_state = target;
        } else {
            KidList kl;
            kl.items.reserve(2);
            kl.items.emplace_back(s.best_token, s.best_state);
            kl.items.emplace_back(token, target);
            kids_.push_back(std::move(kl));
            states_[state].kids = static_cast<int32_t>(kids_.size()) - 1;
            states_[state].distinct = 2;
        }
    }

    // A cached ranking head kept current through an extend that followed the state with ``token``:
    // of a state's continuations only that token's count grows (every transition into a state on
    // the new token's suffix path carries the token), and the best continuation can only become
    // it. The token's entry moves up (or enters, or stays outside a head that is a prefix of the
    // ranking), the old best moves down among equal counts; where the old best then ties with the
    // last entry of a prefix, a continuation outside it might come first: the head is dropped and
    // ranked() ranks the list again.
    static void keep_ranking(KidList& kl, int32_t token, int32_t count, int32_t was_best, int32_t best,
                             int32_t followed) {
        std::vector<std::pair<int32_t, int32_t>>& top = kl.top;
        const auto before = [best](const std::pair<int32_t, int32_t>& x, const std::pair<int32_t, int32_t>& y) {
            if (x.second != y.second) return x.second > y.second;
            if ((x.first == best) != (y.first == best)) return x.first == best;
            return x.first < y.first;
        };
        const auto find = [&top](int32_t t) {
            size_t at = 0;
            while (at < top.size() && top[at].first != t) ++at;
            return at;
        };
        size_t at = find(token);
        if (at < top.size()) {
            top[at].second = count;
        } else if (top.empty() || top.size() >= kl.items.size()) {  // no head lacks the token but a prefix
            kl.top_stamp = -1;
            return;
        } else if (top.size() + 1 == kl.items.size()) {  // the one continuation the head lacked
            top.emplace_back(token, count);
        } else if (before({token, count}, top.back())) {
            top.back() = {token, count};
        } else if (was_best != best) {
            kl.top_stamp = -1;
            return;
        } else {
            kl.top_stamp = followed;  // the token stays below the head, which is unchanged
            return;
        }
        const bool complete = top.size() == kl.items.size();
        if (was_best != best) {
            size_t old = find(was_best);
            if (old < top.size()) {
                if (!complete && top[old].second == top.back().second) {
                    kl.top_stamp = -1;
                    return;
                }
                for (; old + 1 < top.size() && before(top[old + 1], top[old]); ++old) std::swap(top[old], top[old + 1]);
            }
        }
        for (at = find(token); at > 0 && before(top[at], top[at - 1]); --at) std::swap(top[at], top[at - 1]);
        kl.top_stamp = followed;
    }

    void rank_into(const KidList& kl, int32_t best, size_t m, std::vector<std::pair<int32_t, int32_t>>& out) const {
        // SuffixAutomaton.continuations: count descending, then the best continuation, then token id.
        thread_local std::vector<std::pair<int32_t, int32_t>> order;  // (count, token)
        order.clear();
        order.reserve(kl.items.size());
        for (const auto& item : kl.items) order.emplace_back(states_[item.second].count, item.first);
        auto before = [best](const std::pair<int32_t, int32_t>& a, const std::pair<int32_t, int32_t>& b) {
            if (a.first != b.first) return a.first > b.first;
            if ((a.second == best) != (b.second == best)) return a.second == best;
            return a.second < b.second;
        };
        size_t take = std::min(m, order.size());
        std::partial_sort(order.begin(), order.begin() + take, order.end(), before);
        out.clear();
        for (size_t i = 0; i < take; ++i) out.emplace_back(order[i].second, order[i].first);
    }
};

}  // namespace ngramrl
