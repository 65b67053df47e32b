// Rollout history and request state: ngramrl/core/history.py (RolloutHistory) and the request
// half of ngramrl/core/drafter.py (NgramDrafter), with integer request handles.
//
// Each function mirrors its reference counterpart, including when indexes are rebuilt lazily,
// when the least-recently-used order is touched and when the layout counter moves, because all
// of these decide which automaton a later draft reads. The batch core (core.cpp) decides what
// may run in parallel; nothing here locks.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "automaton.hpp"
#include "estimate.hpp"

namespace ngramrl {

using Tokens = std::vector<int32_t>;

// history.py's REBUILD_PACE: a stored rollout adds this many times its tokens to the cross-prompt
// index's replacement while one is built.
constexpr int64_t kRebuildPace = 4;

struct HistoryConfig {
    int64_t rollouts_per_prompt = 64;
    int64_t epochs_kept = 4;
    int64_t max_tokens = 8000000;
    int64_t prompt_tail = 8;
};

struct StoredRollout {
    int64_t epoch;
    Tokens tokens;
};

struct LiveSequence {
    int64_t handle;
    Tokens tokens;
    int32_t cursor;  // its state in the prompt's index (valid while the index is)
};

struct Prompt {
    std::string id;
    Tokens prompt;
    std::deque<StoredRollout> rollouts;
    std::vector<LiveSequence> live;  // insertion order (the order a rebuild adds them)
    std::unique_ptr<Automaton> index;
    bool lingering = false;
    std::list<Prompt*>::iterator lru;

    LiveSequence* find_live(int64_t handle) {
        for (auto& seq : live)
            if (seq.handle == handle) return &seq;
        return nullptr;
    }

    int64_t rollout_tokens() const {
        int64_t n = 0;
        for (const auto& r : rollouts) n += static_cast<int64_t>(r.tokens.size());
        return n;
    }

    int64_t stored_tokens() const {
        int64_t n = static_cast<int64_t>(prompt.size()) + rollout_tokens();
        for (const auto& s : live) n += static_cast<int64_t>(s.tokens.size());
        return n;
    }
};

class History {
public:
    explicit History(const HistoryConfig& config) : config(config) {}

    const HistoryConfig config;
    std::atomic<int64_t> stored{0};
    int64_t evicted_prompts = 0;
    std::atomic<int64_t> rebuilds{0};
    int64_t layout = 0;  // moves when prompts may have left or the cross-prompt index may be replaced
    int64_t global_builds = 0;

    size_t num_prompts() const { return prompts_.size(); }
    const std::list<Prompt*>& lru_order() const { return lru_; }

    Prompt* find(const std::string& id) const {
        auto it = prompts_.find(id);
        return it == prompts_.end() ? nullptr : it->second.get();
    }

    void touch(Prompt* entry) { lru_.splice(lru_.end(), lru_, entry->lru); }

    // The prompt tail and the output: what is indexed for a rollout or a live sequence.
    void sequence(const Tokens& prompt, const int32_t* output, size_t n, Tokens& out) const {
        out.clear();
        if (config.prompt_tail > 0) {
            // prompt[len(prompt) - prompt_tail:] as Python slices it: a negative start counts from
            // the end, so a prompt shorter than the tail gives its last prompt_tail - len tokens.
            const int64_t len = static_cast<int64_t>(prompt.size());
            int64_t start = len - config.prompt_tail;
            if (start < 0) start = std::max<int64_t>(0, len + start);
            out.insert(out.end(), prompt.begin() + start, prompt.end());
        }
        out.insert(out.end(), output, output + n);
    }

    int32_t add_indexed(Automaton& index, const Tokens& prompt, const Tokens& output) const {
        thread_local Tokens seq;
        sequence(prompt, output.data(), output.size(), seq);
        return index.add_sequence(seq);
    }

    void add_rollout(const std::string& id, const Tokens& prompt, const Tokens& output, int64_t epoch) {
        Prompt* entry = entry_for(id, prompt);
        store(entry, epoch, output, true);
    }

    Prompt* entry_for(const std::string& id, const Tokens& prompt) {
        Prompt* entry = find(id);
        if (entry == nullptr) {
            auto owned = std::make_unique<Prompt>();
            owned->id = id;
            owned->prompt = prompt;
            entry = owned.get();
            lru_.push_back(entry);
            entry->lru = std::prev(lru_.end());
            prompts_.emplace(id, std::move(owned));
            stored += static_cast<int64_t>(prompt.size());
        }
        touch(entry);
        return entry;
    }

    // RolloutHistory.drop_rollouts: the prompt's window empties (its live sequences stay); the
    // cross-prompt index counts the tokens as evicted.
    void drop_rollouts(Prompt* entry) {
        const int64_t tokens = entry->rollout_tokens();
        entry->rollouts.clear();
        stored -= tokens;
        entry->index.reset();
        entry->lingering = false;
        if (global_) global_evicted(tokens);
    }

    void store(Prompt* entry, int64_t epoch, const Tokens& tokens, bool index_it) {
        entry->rollouts.push_back(StoredRollout{epoch, tokens});
        stored += static_cast<int64_t>(tokens.size());
        const int64_t evicted = trim_window(entry);
        if (evicted || entry->lingering) {
            entry->lingering = false;
            entry->index.reset();
        } else if (index_it && entry->index) {
            add_indexed(*entry->index, entry->prompt, tokens);
        }
        if (global_) {
            if (next_global_) queue_next(entry->prompt, tokens);
            global_evicted(evicted);  // a replacement it starts finds this rollout in the window
            add_indexed(*global_, entry->prompt, tokens);
            global_tokens_ += static_cast<int64_t>(tokens.size());
            build_next_global(kRebuildPace * static_cast<int64_t>(tokens.size()));
        } else if (index_it) {
            layout += 1;
        }
        enforce_cap();
    }

    bool begin_live(const std::string& id, int64_t handle, const Tokens& output, const Tokens* prompt) {
        Prompt* entry = find(id);
        if (entry == nullptr) {
            if (prompt == nullptr) return false;
            entry = entry_for(id, *prompt);
        }
        LiveSequence* existing = entry->find_live(handle);
        if (existing == nullptr) {
            entry->live.push_back(LiveSequence{handle, output, -1});
            existing = &entry->live.back();
        } else {
            existing->tokens = output;
        }
        stored += static_cast<int64_t>(output.size());
        if (entry->index) existing->cursor = add_indexed(*entry->index, entry->prompt, existing->tokens);
        return true;
    }

    // extend_live, given the entry the prompt id names now (or null).
    void extend_live(Prompt* entry, int64_t handle, const Tokens& tokens) {
        if (entry == nullptr) return;
        LiveSequence* seq = entry->find_live(handle);
        if (seq == nullptr) return;
        seq->tokens.insert(seq->tokens.end(), tokens.begin(), tokens.end());
        stored += static_cast<int64_t>(tokens.size());
        if (entry->index && seq->cursor >= 0) {
            Automaton& index = *entry->index;
            int32_t cursor = seq->cursor;
            for (int32_t token : tokens) cursor = index.extend(cursor, token);
            seq->cursor = cursor;
        }
    }

    // end_live(prompt_id, handle, epoch or none, linger)
    void end_live(const std::string& id, int64_t handle, bool has_epoch, int64_t epoch, bool linger) {
        Prompt* entry = find(id);
        if (entry == nullptr) return;
        LiveSequence* seq = entry->find_live(handle);
        if (seq == nullptr) return;
        Tokens tokens = std::move(seq->tokens);
        entry->live.erase(entry->live.begin() + (seq - entry->live.data()));
        stored -= static_cast<int64_t>(tokens.size());
        if (!has_epoch && linger) {
            entry->lingering = entry->lingering || (!tokens.empty() && entry->index != nullptr);
        } else if (!has_epoch) {
            if (!tokens.empty() || entry->index) entry->index.reset();
        } else {
            store(entry, epoch, tokens, false);
        }
    }

    // RolloutHistory.drop_ended
    void drop_ended(const std::string& id) {
        Prompt* entry = find(id);
        if (entry == nullptr || !entry->lingering) return;
        entry->lingering = false;
        entry->index.reset();
    }

    // index_of for an entry the caller found: touches it and builds its index if needed.
    Automaton* indexed(Prompt* entry) {
        touch(entry);
        return ensure_index(entry);
    }

    // The build half of ``_indexed`` (the caller applies the touch in the reference's order).
    Automaton* ensure_index(Prompt* entry) {
        if (!entry->index) rebuild(entry);
        return entry->index.get();
    }

    Automaton* built_global() const { return global_.get(); }

    Automaton* global_index() {
        if (!global_) {
            auto index = std::make_unique<Automaton>();
            int64_t tokens = 0;
            for (Prompt* entry : lru_) {
                for (const auto& r : entry->rollouts) {
                    add_indexed(*index, entry->prompt, r.tokens);
                    tokens += static_cast<int64_t>(r.tokens.size());
                }
            }
            index->shrink();
            global_ = std::move(index);
            global_tokens_ = tokens;
            global_stale_ = 0;
            global_builds += 1;
        }
        return global_.get();
    }

    void clear() {
        lru_.clear();
        prompts_.clear();
        stored = 0;
        global_.reset();
        global_tokens_ = 0;
        global_stale_ = 0;
        next_global_.reset();
        next_queue_.clear();
        next_tokens_ = next_stale_ = 0;
        layout += 1;
    }

    size_t memory_bytes() const {
        constexpr size_t kHeap = 16;
        size_t bytes = sizeof(*this) + prompts_.bucket_count() * sizeof(void*);
        for (const auto& kv : prompts_) {
            const Prompt& p = *kv.second;
            bytes += sizeof(Prompt) + kHeap + 48 + kHeap /* map node */ + 24 + kHeap /* lru node */;
            bytes += p.id.capacity() > 15 ? p.id.capacity() + 1 + kHeap : 0;
            bytes += p.prompt.capacity() * 4 + kHeap;
            bytes += p.rollouts.size() * sizeof(StoredRollout) + 512 + kHeap;  // deque blocks (approx. from above)
            for (const auto& r : p.rollouts) bytes += r.tokens.capacity() * 4 + kHeap;
            bytes += p.live.capacity() * sizeof(LiveSequence) + kHeap;
            for (const auto& s : p.live) bytes += s.tokens.capacity() * 4 + kHeap;
            if (p.index) bytes += p.index->memory_bytes() + kHeap;
        }
        if (global_) bytes += global_->memory_bytes() + kHeap;
        if (next_global_) bytes += next_global_->memory_bytes() + kHeap;
        for (const auto& q : next_queue_) bytes += sizeof(QueuedRollout) + q.sequence.capacity() * 4 + kHeap;
        return bytes;
    }

private:
    std::unordered_map<std::string, std::unique_ptr<Prompt>> prompts_;
    std::list<Prompt*> lru_;  // least recently used first
    std::unique_ptr<Automaton> global_;
    int64_t global_tokens_ = 0;
    int64_t global_stale_ = 0;
    // The cross-prompt index's replacement while it is built (history.py's _next_*): the index so
    // far, the rollouts still to add (their indexed sequences, copied: a rollout may leave its
    // window before it is added), and its own counts.
    struct QueuedRollout {
        Tokens sequence;
        int64_t tokens;  // the rollout's own (the sequence less the prompt tail)
    };
    std::unique_ptr<Automaton> next_global_;
    std::deque<QueuedRollout> next_queue_;
    int64_t next_tokens_ = 0;
    int64_t next_stale_ = 0;

    void queue_next(const Tokens& prompt, const Tokens& tokens) {
        QueuedRollout queued{{}, static_cast<int64_t>(tokens.size())};
        sequence(prompt, tokens.data(), tokens.size(), queued.sequence);
        next_queue_.push_back(std::move(queued));
    }

    // RolloutHistory._global_evicted
    void global_evicted(int64_t tokens) {
        global_stale_ += tokens;
        if (next_global_) {
            next_stale_ += tokens;
        } else if (2 * global_stale_ > global_tokens_) {
            next_global_ = std::make_unique<Automaton>();
            next_queue_.clear();
            for (Prompt* entry : lru_)
                for (const auto& r : entry->rollouts) queue_next(entry->prompt, r.tokens);
            next_tokens_ = next_stale_ = 0;
        }
    }

    // RolloutHistory._build_next_global
    void build_next_global(int64_t budget) {
        if (!next_global_) return;
        while (!next_queue_.empty()) {
            const QueuedRollout& queued = next_queue_.front();
            next_global_->add_sequence(queued.sequence);
            next_tokens_ += queued.tokens;
            budget -= queued.tokens;
            next_queue_.pop_front();
            if (budget <= 0) break;
        }
        if (next_queue_.empty()) {
            next_global_->shrink();
            global_ = std::move(next_global_);
            global_tokens_ = next_tokens_;
            global_stale_ = next_stale_;
            global_builds += 1;
            layout += 1;
        }
    }

    int64_t trim_window(Prompt* entry) {
        int64_t newest = entry->rollouts.front().epoch;
        for (const auto& r : entry->rollouts) newest = std::max(newest, r.epoch);
        int64_t evicted = 0;
        while (!entry->rollouts.empty() &&
               (static_cast<int64_t>(entry->rollouts.size()) > config.rollouts_per_prompt ||
                entry->rollouts.front().epoch <= newest - config.epochs_kept)) {
            const int64_t gone = static_cast<int64_t>(entry->rollouts.front().tokens.size());
            entry->rollouts.pop_front();
            stored -= gone;
            evicted += gone;
        }
        return evicted;
    }

    void enforce_cap() {
        while (stored > config.max_tokens && prompts_.size() > 1) {
            Prompt* entry = lru_.front();
            lru_.pop_front();
            stored -= entry->stored_tokens();
            evicted_prompts += 1;
            layout += 1;
            if (global_) global_evicted(entry->rollout_tokens());
            const std::string id = entry->id;
            prompts_.erase(id);
        }
    }

    void rebuild(Prompt* entry) {
        auto index = std::make_unique<Automaton>();
        size_t total = entry->prompt.size();
        for (const auto& r : entry->rollouts) total += r.tokens.size() + config.prompt_tail;
        for (const auto& s : entry->live) total += s.tokens.size() + config.prompt_tail;
        index->reserve(total);
        index->add_sequence(entry->prompt);
        for (const auto& r : entry->rollouts) add_indexed(*index, entry->prompt, r.tokens);
        for (auto& s : entry->live) s.cursor = add_indexed(*index, entry->prompt, s.tokens);
        index->shrink();
        entry->index = std::move(index);
        entry->lingering = false;
        rebuilds += 1;
    }
};

}  // namespace ngramrl
