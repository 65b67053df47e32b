// ngramrl._native: the batched drafting core (see ngramrl/core/batch.py for what each call means).
//
// A Core owns the rollout history, the live requests (integer handles), the acceptance
// calibration and the prefetch cache. Every call releases the GIL. Within a step:
//   - inserts into the prompts' indexes run one prompt per task (rows of one prompt in row order),
//   - lookups and outcome predictions only read the indexes and run one chunk of rows per task,
//   - whatever touches shared bookkeeping (the LRU order, lazy rebuilds, the layout counter)
//     runs on the calling thread in the reference's order.
// absorb() and prefetch() are queued to the first of the core's workers (the background) and
// joined by the next call, so the results never depend on timing.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

#include "automaton.hpp"
#include "cost.hpp"
#include "estimate.hpp"
#include "history.hpp"
#include "rows.hpp"

namespace py = pybind11;

namespace ngramrl {

// -- threads ----------------------------------------------------------------------------------

// A spinning thread's pause: lets the core's other hardware thread (or the hypervisor) run.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

// Keeps ``thread`` to ``cores`` (CPU ids; empty: wherever the process may run). Linux only; a set
// the OS refuses (cores outside a container's share) leaves the thread where it was.
inline void pin_thread(std::thread& thread, const std::vector<int>& cores) {
#ifdef __linux__
    if (cores.empty()) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int core : cores)
        if (core >= 0 && core < CPU_SETSIZE) CPU_SET(core, &set);
    if (CPU_COUNT(&set) > 0) pthread_setaffinity_np(thread.native_handle(), sizeof(set), &set);
#else
    (void)thread;
    (void)cores;
#endif
}

// The core's threads: threads - 1 workers (at least one) that run background jobs (one at a
// time, in the order submitted, on the first worker) and the tasks of runs (a step's, from the
// calling thread, with every worker; a background job's, with the other workers, so a core stays
// with the thread that runs the forward meanwhile).
//
// A run's calling thread runs tasks too and never waits for a worker that has not started: a
// worker that comes late finds the tasks taken, so a run takes at most what the calling thread
// alone would, plus the task a worker holds. A worker that just worked stays awake for a while
// (kLinger), because a thread woken from sleep starts late: on a VM 0.25-2 ms, against a step's
// phases of 0.05-0.8 ms, so a step whose workers slept ran on its calling thread alone. The work
// comes in bursts a forward apart: the prefetch job until the step stops it, the step's runs right
// after, the next prefetch job right after those; a worker awake from the job to the step's runs
// and on to the next job sleeps only during what is left of a forward.
class Workers {
public:
    // With one thread the background jobs still get a worker (a forward's worth of time), and
    // runs stay on their calling thread.
    // ``cores``: where the workers run (empty: anywhere). A thread inherits its creator's cores,
    // and vLLM binds the thread that creates the core to the forward's.
    Workers(int threads, const std::vector<int>& cores) : threads_(std::max(1, threads)) {
        for (int i = 1; i < std::max(2, threads_); ++i) {
            workers_.emplace_back([this, i] { loop(i == 1); });
            pin_thread(workers_.back(), cores);  // before the constructor returns: callers may rely on it
        }
    }
    ~Workers() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_ = true;
        }
        wake_.notify_all();
        for (auto& t : workers_) t.join();
    }
    int threads() const { return threads_; }

    // Queue a background job.
    void submit(std::function<void()> job) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            queue_.push_back(std::move(job));
            queued_.store(queue_.size());
        }
        wake_.notify_all();
    }

    // The workers are about to be given a run: the ones asleep wake and spin for it (a worker
    // woken by the run itself arrives after the calling thread has taken most of its tasks).
    void rouse() {
        if (threads_ == 1) return;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            rousals_ += 1;
        }
        wake_.notify_all();
    }

    // Wait for the queued jobs to finish; a job that failed raises its error here (once).
    void wait() {
        std::unique_lock<std::mutex> lock(mutex_);
        idle_.wait(lock, [this] { return queue_.empty() && !busy_; });
        if (failed_) std::rethrow_exception(std::exchange(failed_, nullptr));
    }

    // Wait at most ``seconds`` for the queued jobs to finish; whether they had.
    bool wait_for(double seconds) {
        std::unique_lock<std::mutex> lock(mutex_);
        return idle_.wait_for(lock, std::chrono::duration<double>(std::max(0.0, seconds)),
                              [this] { return queue_.empty() && !busy_; });
    }

    // fn(task) for task in [0, tasks), spread over the calling thread and the workers not busy.
    void run(size_t tasks, const std::function<void(size_t)>& fn) {
        if (threads_ == 1 || tasks <= 1) {
            for (size_t i = 0; i < tasks; ++i) fn(i);
            return;
        }
        std::lock_guard<std::mutex> one_run(run_mutex_);  // callers join the background first; this is a guard
        {
            std::lock_guard<std::mutex> lock(mutex_);
            job_ = &fn;
            total_ = tasks;
            next_.store(0);
            finished_.store(0);
            generation_.fetch_add(1);
        }
        wake_.notify_all();
        work();
        // What is left are tasks that started on a worker, and workers leaving the run: spin for
        // them (waking this thread would cost more than they take), then end the run for late ones.
        for (uint32_t n = 0;; ++n) {
            if (finished_.load() == total_ && working_.load() == 0) {
                std::lock_guard<std::mutex> lock(mutex_);  // a late worker joins under it
                if (working_.load() == 0) {
                    job_ = nullptr;
                    return;
                }
            }
            if (n >= kSpinsBeforeYield) std::this_thread::yield();  // the scheduler may have put a worker here
        }
    }

private:
    using Clock = std::chrono::steady_clock;
    static constexpr uint32_t kSpinsBeforeYield = 4096;  // a few microseconds of loads
    static constexpr auto kLinger = std::chrono::milliseconds(2);

    const int threads_;
    std::vector<std::thread> workers_;
    std::mutex mutex_, run_mutex_;
    std::condition_variable wake_, idle_;
    std::deque<std::function<void()>> queue_;
    std::atomic<size_t> queued_{0};              // queue_.size(), for a spinning worker (changed under mutex_)
    bool busy_ = false, stop_ = false;           // a job is running; the workers end
    std::exception_ptr failed_;                  // the first background job that failed, until wait()
    uint64_t rousals_ = 0;                       // rouse() calls (changed under mutex_)
    const std::function<void(size_t)>* job_ = nullptr;  // the current run's; null once run() returns
    size_t total_ = 0;
    std::atomic<size_t> next_{0}, finished_{0};  // the run's tasks taken, and done
    std::atomic<int> working_{0};                // workers inside the current run (changed under mutex_)
    std::atomic<uint64_t> generation_{0};        // runs started (changed under mutex_)

    void work() {
        for (size_t i = next_.fetch_add(1); i < total_; i = next_.fetch_add(1)) {
            (*job_)(i);
            finished_.fetch_add(1);
        }
    }

    // ``jobs``: this worker runs the background jobs.
    void loop(bool jobs) {
        uint64_t seen = 0;
        auto awake_until = Clock::now() + kLinger;
        std::unique_lock<std::mutex> lock(mutex_);
        while (!stop_) {
            if (generation_.load() != seen) {
                seen = generation_.load();
                if (job_ == nullptr) continue;  // that run is over
                ++working_;
                lock.unlock();
                work();
                lock.lock();
                --working_;
            } else if (jobs && !queue_.empty()) {
                std::function<void()> job = std::move(queue_.front());
                queue_.pop_front();
                queued_.store(queue_.size());
                busy_ = true;
                lock.unlock();
                std::exception_ptr failed;
                try {
                    job();
                } catch (...) {  // uncaught on this thread it would end the process
                    failed = std::current_exception();
                }
                lock.lock();
                if (failed && !failed_) failed_ = failed;
                busy_ = false;
                if (queue_.empty()) idle_.notify_all();
            } else if (Clock::now() < awake_until) {
                lock.unlock();
                for (uint32_t n = 1; generation_.load(std::memory_order_relaxed) == seen &&
                                     !(jobs && queued_.load(std::memory_order_relaxed) > 0);
                     ++n) {
                    cpu_relax();
                    if (n % 64 == 0 && Clock::now() >= awake_until) break;
                }
                lock.lock();
                continue;
            } else {
                const uint64_t roused = rousals_;
                wake_.wait(lock, [&] {
                    return stop_ || generation_.load() != seen || (jobs && !queue_.empty()) || rousals_ != roused;
                });
            }
            awake_until = Clock::now() + kLinger;
        }
    }
};

// -- requests ---------------------------------------------------------------------------------

struct LookState {
    Match match;
    Tokens behind;  // committed, not yet stepped into ``match``
    Automaton* global = nullptr;
    uint64_t global_serial = 0;
    Match global_match;
    Tokens global_behind;
};

struct Stamp {
    int64_t layout;
    uint64_t index_serial;
    int64_t index_tokens;
    uint64_t global_serial;
    int64_t global_tokens;
    bool operator==(const Stamp& o) const {
        return layout == o.layout && index_serial == o.index_serial && index_tokens == o.index_tokens &&
               global_serial == o.global_serial && global_tokens == o.global_tokens;
    }
};

// The match states the outcome model walked for a request's draft: after d_1..d_j for each j it
// read, in its prompt's index and in the cross-prompt one. A miss that committed d_1..d_j + [b]
// resumes from them (one automaton step) instead of catching up from the old context: the same
// state, since Automaton::step is what the catch-up does token by token.
struct Walked {
    uint64_t generation = 0;  // the prefetch that walked them (0: none)
    Stamp stamp{};            // what they read
    Match from, global_from;  // the request's match states they started from
    size_t global_behind = 0;
    bool global = false;      // whether the cross-prompt chain was walked
    Tokens draft;
    std::vector<Match> prompt_chain, global_chain;  // [j]: after draft[:j]
};

struct Request {
    int64_t handle;
    std::string prompt_id;
    Tokens prompt, output;
    bool known = false;
    Prompt* entry = nullptr;     // its prompt, found under ``layout`` (alive while the layout stays)
    Automaton* index = nullptr;  // valid while holds_current_index
    uint64_t index_serial = 0;
    Tokens pending;  // committed, not yet in the index
    LookState ls;
    int64_t layout = -1;
    // The draft being followed (DraftFollower): compared with the tokens committed after it.
    bool following = false;
    Tokens follow_tokens;
    std::vector<double> follow_probs;
    int32_t follow_matched = 0;
    uint64_t seen_in_call = 0;  // the last checked call that named this request (each row once per call)
    Walked walked;
};

struct DrafterConfig {
    int32_t max_draft = 16;
    ChainConfig chain;
    int32_t rematch_tokens = 32;
    bool use_global = true;
};

struct PrefetchConfig {
    AllocateConfig allocate;      // allocate.budget: the most outcomes one request gets
    int64_t shared_budget = -1;   // >= 0: the batch's total is this x its planned requests (outcome.allocation)
    double plan_floor = 0.0;      // with a batch total: outcomes enumerated only above this x the last cut
    int32_t levels = 3;
};

struct CacheKey {
    int64_t handle;
    int32_t accepted, token;
    bool operator==(const CacheKey& o) const { return handle == o.handle && accepted == o.accepted && token == o.token; }
};

// The prefetched outcome a row's commit matches: j accepted draft tokens and then b commit j + 1
// tokens, the last of them b.
inline CacheKey committed_outcome(int64_t handle, const int32_t* committed, size_t count) {
    return CacheKey{handle, static_cast<int32_t>(count) - 1, committed[count - 1]};
}

struct CacheKeyHash {
    size_t operator()(const CacheKey& k) const {
        uint64_t h = static_cast<uint64_t>(k.handle) * 0x9E3779B97F4A7C15ull;
        h ^= (static_cast<uint64_t>(static_cast<uint32_t>(k.token)) << 20) ^ static_cast<uint32_t>(k.accepted);
        return static_cast<size_t>(h * 0xBF58476D1CE4E5B9ull >> 17);
    }
};

// The prefetched outcomes by (request, j, b), for the step's commits: open addressing in one array
// (a find is mostly one cache line, where a node-based map reads its bucket and then its node),
// emptied by a new stamp rather than by writing every slot.
class OutcomeTable {
public:
    void reset(size_t entries) {
        size_t size = 16;
        while (size < 2 * entries) size *= 2;
        if (slots_.size() < size) {
            slots_.assign(size, Slot{});
            stamp_ = 0;
        }
        if (++stamp_ == 0) {  // the stamps wrapped: forget every slot
            std::fill(slots_.begin(), slots_.end(), Slot{});
            stamp_ = 1;
        }
    }

    void insert(const CacheKey& key, int32_t value) {
        const size_t mask = slots_.size() - 1;
        for (size_t at = CacheKeyHash{}(key) & mask;; at = (at + 1) & mask) {
            Slot& slot = slots_[at];
            if (slot.stamp != stamp_ || slot.key == key) {
                slot = Slot{key, value, stamp_};
                return;
            }
        }
    }

    // A cache hint for the slot a find of ``key`` reads first.
    void hint(const CacheKey& key) const {
        if (!slots_.empty()) __builtin_prefetch(&slots_[CacheKeyHash{}(key) & (slots_.size() - 1)]);
    }

    // The value stored for ``key``, or -1.
    int32_t find(const CacheKey& key) const {
        if (slots_.empty()) return -1;
        const size_t mask = slots_.size() - 1;
        for (size_t at = CacheKeyHash{}(key) & mask;; at = (at + 1) & mask) {
            const Slot& slot = slots_[at];
            if (slot.stamp != stamp_) return -1;
            if (slot.key == key) return slot.value;
        }
    }

private:
    struct Slot {
        CacheKey key{-1, 0, 0};
        int32_t value = -1;
        uint32_t stamp = 0;
    };
    std::vector<Slot> slots_;
    uint32_t stamp_ = 0;
};

template <typename T>
py::array_t<T> to_array(const std::vector<T>& v) {
    py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
    if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(T));
    return out;
}

template <typename T>
std::vector<T> from_array(const py::array_t<T, py::array::c_style | py::array::forcecast>& a) {
    return std::vector<T>(a.data(), a.data() + a.size());
}

// One token id of ``where``, at ``i``: refused unless it is a non-negative 32-bit value.
inline int32_t checked_token(long long v, const std::string& where, py::ssize_t i) {
    if (v < 0 || v > INT32_MAX)
        throw py::value_error(where + "[" + std::to_string(i) + "] = " + std::to_string(v) +
                              (v < 0 ? " is negative (token ids are >= 0)" : " is not a 32-bit token id"));
    return static_cast<int32_t>(v);
}

// The token ids of ``where`` as the engine hands them over: a NumPy array, or any sequence of
// ints (vLLM's lists) read in place, without an array made per request. Bad values are reported
// with their position, as the reference's ``token_ids`` does.
Tokens token_ids(py::handle obj, const std::string& where) {
    if (py::isinstance<py::array>(obj)) {
        const auto array = py::reinterpret_borrow<py::array>(obj);
        const char kind = array.dtype().kind();
        if (array.size() > 0 && kind != 'i' && kind != 'u')  // (an empty array of any type has no bad id)
            throw py::value_error(where + " is an array of " + std::string(py::str(array.dtype())) +
                                  ", not of integer token ids");
        auto a = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(obj);
        if (!a) throw py::value_error(where + " is not an array of integer token ids");
        Tokens out(static_cast<size_t>(a.size()));
        for (py::ssize_t i = 0; i < a.size(); ++i) out[i] = checked_token(a.data()[i], where, i);
        return out;
    }
    if (PyUnicode_Check(obj.ptr()) || PyBytes_Check(obj.ptr()) || !PySequence_Check(obj.ptr()))
        throw py::value_error(where + " must be a sequence of token ids, got " + std::string(py::repr(obj)));
    py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(obj.ptr(), "not a sequence"));
    if (!seq) throw py::error_already_set();
    const py::ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
    PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
    Tokens out(static_cast<size_t>(n));
    for (py::ssize_t i = 0; i < n; ++i) {
        PyObject* item = items[i];
        if (PyBool_Check(item))
            throw py::value_error(where + "[" + std::to_string(i) + "] is not a token id: " + std::string(py::repr(item)));
        const long long v = PyLong_AsLongLong(item);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            throw py::value_error(where + "[" + std::to_string(i) + "] is not an integer token id: " +
                                  std::string(py::repr(item)));
        }
        out[i] = checked_token(v, where, i);
    }
    return out;
}

// token_ids of ``what``[``row``]: one request's tokens of a batch.
Tokens token_ids(py::handle obj, const char* what, size_t row) {
    return token_ids(obj, std::string(what) + "[" + std::to_string(row) + "]");
}

inline int64_t checked_epoch(int64_t epoch, const std::string& what) {
    if (epoch < 0) throw py::value_error(what + " must be an integer >= 0, got " + std::to_string(epoch));
    return epoch;
}

// -- the core ---------------------------------------------------------------------------------

class Core {
public:
    Core(const HistoryConfig& history, const DrafterConfig& drafter, const PrefetchConfig& prefetch,
         double prior_strength, double calibration_decay, int threads, bool follow, const std::vector<int>& cores)
        : history_(history), config_(drafter), prefetch_(prefetch), follow_(follow),
          calibration_(prior_strength, calibration_decay),
          workers_(threads, cores) {}

    ~Core() { workers_.wait(); }

    // ---- history --------------------------------------------------------------------------

    void add_rollout(const std::string& id, const Tokens& prompt, const Tokens& output, int64_t epoch) {
        join();
        history_.add_rollout(id, prompt, output, epoch);
    }

    // RolloutHistory.index_of: the prompt's index built now (touching it); false for an unknown prompt.
    bool index_prompt(const std::string& id) {
        join();
        Prompt* entry = history_.find(id);
        if (entry == nullptr) return false;
        history_.indexed(entry);
        return true;
    }

    void build_indexes() {
        join();
        std::vector<Prompt*> order(history_.lru_order().begin(), history_.lru_order().end());
        for (Prompt* entry : order) history_.indexed(entry);
        if (config_.use_global) history_.global_index();
    }

    py::list export_history() {
        join();
        py::list out;
        for (Prompt* entry : history_.lru_order()) out.append(exported(entry));
        return out;
    }

    // export_history for the known prompts among ``ids``, in that order.
    py::list export_prompts(const std::vector<std::string>& ids) {
        join();
        py::list out;
        for (const auto& id : ids) {
            Prompt* entry = history_.find(id);
            if (entry != nullptr) out.append(exported(entry));
        }
        return out;
    }

    static py::tuple exported(const Prompt* entry) {
        py::list rollouts;
        for (const auto& r : entry->rollouts) rollouts.append(py::make_tuple(r.epoch, py::cast(r.tokens)));
        return py::make_tuple(entry->id, py::cast(entry->prompt), rollouts);
    }

    void clear() {
        join();
        history_.clear();
    }

    // RolloutHistory.restore for one exported prompt: registered, then its rollouts in order
    // (``replace``: in place of the rollouts it had).
    void restore_prompt(const std::string& id, const Tokens& prompt, const std::vector<std::pair<int64_t, Tokens>>& rollouts,
                        bool replace) {
        check_tokens(prompt, "prompt");
        for (const auto& r : rollouts) {
            if (r.first < 0) throw py::value_error("epoch must be an integer >= 0, got " + std::to_string(r.first));
            check_tokens(r.second, "rollout");
        }
        join();
        // The entry is the most recently used: the token cap evicts it only when it is alone, which it never does.
        Prompt* entry = history_.entry_for(id, prompt);
        if (replace) history_.drop_rollouts(entry);
        for (const auto& r : rollouts) history_.store(entry, r.first, r.second, true);
    }

    int64_t stored_tokens() {
        join();
        return history_.stored.load();
    }

    size_t num_prompts() {
        join();
        return history_.num_prompts();
    }

    std::vector<std::string> prompt_ids() {
        join();
        std::vector<std::string> out;
        for (Prompt* entry : history_.lru_order()) out.push_back(entry->id);
        return out;
    }

    size_t rollout_count(const std::string& id) {
        join();
        Prompt* entry = history_.find(id);
        return entry ? entry->rollouts.size() : 0;
    }

    std::map<std::string, int64_t> counters() {
        join();
        return {{"layout", history_.layout}, {"rebuilds", history_.rebuilds.load()},
                {"global_builds", history_.global_builds}, {"evicted_prompts", history_.evicted_prompts}};
    }

    // (states, tokens, sequences) of a prompt's index ("" : the cross-prompt one), built or not: -1s.
    std::vector<int64_t> index_shape(const std::string& id) {
        join();
        const Automaton* a = nullptr;
        if (id.empty()) {
            a = history_.built_global();
        } else if (Prompt* entry = history_.find(id)) {
            a = entry->index.get();
        }
        if (a == nullptr) return {-1, -1, -1};
        return {a->num_states(), a->num_tokens, a->num_sequences};
    }

    size_t memory_bytes() {
        join();
        size_t bytes = sizeof(*this) + history_.memory_bytes();
        for (const auto& r : requests_) {
            if (!r) continue;
            bytes += sizeof(Request) + 16 + (r->prompt.capacity() + r->output.capacity() + r->pending.capacity() +
                                             r->ls.behind.capacity() + r->ls.global_behind.capacity()) * 4;
        }
        return bytes + requests_.size() * sizeof(void*);
    }

    // ---- requests -------------------------------------------------------------------------

    // The requests start in the order given (their handles rise with it): one call for the
    // requests an engine step admits, which at a few hundred in flight are a few dozen a step.
    std::vector<int64_t> start(const std::vector<std::string>& ids, std::vector<Tokens>& prompts,
                               std::vector<Tokens>& outputs, bool register_prompt) {
        join();
        std::vector<int64_t> handles(ids.size());
        for (size_t i = 0; i < ids.size(); ++i) {
            auto request = std::make_unique<Request>();
            request->handle = first_handle_ + static_cast<int64_t>(requests_.size());
            request->prompt_id = ids[i];
            request->prompt = std::move(prompts[i]);
            request->output = std::move(outputs[i]);
            request->known = history_.begin_live(ids[i], request->handle, request->output,
                                                 register_prompt ? &request->prompt : nullptr);
            if (request->known) index(*request);
            handles[i] = request->handle;
            requests_.push_back(std::move(request));
        }
        return handles;
    }

    // The requests' handles are released at once; their tokens enter the history in the
    // background, in the order given, as one job queued behind any background work (which may
    // still read them), before the next call that reads the history: the work of the requests
    // that end at a step overlaps what the caller does before that step. Every handle is checked
    // before any request ends.
    void finish(const std::vector<int64_t>& handles, bool has_epoch, const std::vector<int64_t>& epochs,
                bool linger) {
        if (has_epoch && epochs.size() != handles.size())
            throw py::value_error("finish got " + std::to_string(epochs.size()) + " epochs for " +
                                  std::to_string(handles.size()) + " requests");
        for (size_t i = 0; i < handles.size(); ++i) {
            get(handles[i]);
            if (has_epoch && epochs[i] < 0)
                throw py::value_error("epoch must be >= 0, got " + std::to_string(epochs[i]));
        }
        std::vector<int64_t> sorted(handles);
        std::sort(sorted.begin(), sorted.end());
        const auto twice = std::adjacent_find(sorted.begin(), sorted.end());
        if (twice != sorted.end())
            throw py::value_error("request handle " + std::to_string(*twice) + " is finished twice");
        if (handles.empty()) return;
        std::vector<std::shared_ptr<Request>> ending;
        ending.reserve(handles.size());
        for (const int64_t handle : handles) ending.emplace_back(std::move(requests_[handle - first_handle_]));
        // The handles keep rising (they rank the requests by arrival); the slots before the oldest
        // live request go, so what a long run's finished requests leave behind stays bounded.
        while (!requests_.empty() && !requests_.front()) {
            requests_.pop_front();
            ++first_handle_;
        }
        workers_.submit([this, ending = std::move(ending), has_epoch, epochs, linger] {
            for (size_t i = 0; i < ending.size(); ++i) {
                Request& r = *ending[i];
                if (!r.known) continue;
                absorb_one(r);
                history_.end_live(r.prompt_id, r.handle, has_epoch, has_epoch ? epochs[i] : 0, linger);
                r.known = false;
            }
        });
    }

    // ReferenceCore.drop_ended, once the requests ending in the background have ended.
    void drop_ended(const std::vector<std::string>& ids) {
        join();
        for (const auto& id : ids) history_.drop_ended(id);
    }

    bool known(int64_t handle) {
        join();
        return get(handle).known;
    }

    // ---- a step ---------------------------------------------------------------------------

    void step(const std::vector<int64_t>& handles, const Tokens& tokens, const std::vector<int64_t>& offsets,
              const std::vector<int32_t>& ks) {
        const int64_t called = now_ns();
        join();
        const int64_t begin = now_ns();
        timings_["step_wait_ns"] += begin - called;
        const size_t rows = handles.size();
        check_rows(rows, tokens.size(), offsets);
        check_tokens(tokens, "committed tokens");
        if (ks.size() != rows)
            throw py::value_error("ks has " + std::to_string(ks.size()) + " entries for " + std::to_string(rows) +
                                  " rows");
        std::vector<Request*> reqs = rows_of(handles);
        const std::vector<size_t> order = arrival_order(reqs);
        if (follow_) {
            follow_accepted_.assign(rows, -1);
            follow_upto_.resize(rows);
            follow_cells_.resize(rows * follow_stride_);
        }
        bool any_k = false;
        for (int32_t k : ks) any_k = any_k || k > 0;
        if (any_k) absorb_rows(reqs, order);
        const int64_t absorbed = now_ns();
        timings_["step_absorb_ns"] += absorbed - begin;
        drafts_.resize(rows);
        hits_.assign(rows, 0);
        resumed_.assign(rows, 0);
        lookups_.clear();
        // A row whose index is current (the layout has not moved since it was found, nothing is
        // pending) commits without touching anything shared: those rows commit on any thread. The
        // others find their index again, which may rebuild it and touches the LRU order: those
        // commit on this thread first, in arrival order. A cross-prompt index not built yet is
        // built at the first lookup, after the commits before it (the order the build reads the
        // prompts in): then every row commits here, in arrival order.
        const bool any_thread = workers_.threads() > 1 && (!config_.use_global || history_.built_global() != nullptr);
        wants_lookup_.assign(rows, 0);
        Tokens committed;
        if (!any_thread) {
            for (const size_t i : order) {
                commit_row(*reqs[i], i, tokens, offsets, ks[i], committed);
                if (wants_lookup_[i] && config_.use_global) history_.global_index();
            }
        } else {
            done_.assign(rows, 0);
            for (const size_t i : order)
                if (ks[i] > 0 && !current(*reqs[i])) {
                    commit_row(*reqs[i], i, tokens, offsets, ks[i], committed);
                    done_[i] = 1;
                }
            constexpr size_t kChunk = 64;
            workers_.run((rows + kChunk - 1) / kChunk, [&](size_t c) {
                thread_local Tokens mine;
                const size_t end = std::min(rows, (c + 1) * kChunk);
                for (size_t i = c * kChunk; i < end; ++i) {
                    if (i + 2 < end) hint_request(*reqs[i + 2]);
                    if (i + 1 < end) hint_commit(*reqs[i + 1], i + 1, tokens, offsets);
                    if (!done_[i]) commit_row(*reqs[i], i, tokens, offsets, ks[i], mine);
                }
            });
        }
        if (follow_) observe_followed(order);
        for (const size_t i : order)
            if (wants_lookup_[i]) lookups_.push_back(static_cast<int32_t>(i));
        const int64_t committed_at = now_ns();
        timings_["step_commit_ns"] += committed_at - absorbed;
        timings_["step_lookups"] += static_cast<int64_t>(lookups_.size());
        cache_valid_ = false;  // used once; emptied in the background, by the next prefetch
        Automaton* global = history_.built_global();
        // Lookups read the indexes only: any row on any thread.
        constexpr size_t kChunk = 8;
        const size_t chunks = (lookups_.size() + kChunk - 1) / kChunk;
        workers_.run(chunks, [&](size_t c) {
            const size_t begin = c * kChunk, end = std::min(lookups_.size(), (c + 1) * kChunk);
            thread_local std::vector<std::vector<SourceMatch>> sources;
            thread_local std::vector<int32_t> row_ks;
            thread_local std::vector<DraftOut*> outs;
            sources.resize(end - begin);
            row_ks.clear();
            outs.clear();
            // A row that resumes committed d_1..d_j + [b]: j accepted tokens, then b.
            const auto accepted = [&](int32_t i) { return static_cast<size_t>(offsets[i + 1] - offsets[i] - 1); };
            for (size_t n = begin; n < end; ++n) {  // the walked states the misses resume from
                const int32_t i = lookups_[n];
                if (!resumed_[i]) continue;
                const Request& r = *reqs[i];
                const size_t j = accepted(i);
                r.index->prefetch_state(r.walked.prompt_chain[j].state);
                if (resumes_global(r, j, global)) global->prefetch_state(r.walked.global_chain[j].state);
            }
            for (size_t n = begin; n < end; ++n) {
                const int32_t i = lookups_[n];
                if (resumed_[i]) resume(*reqs[i], accepted(i), tokens[offsets[i + 1] - 1]);
            }
            for (size_t n = begin; n < end; ++n) {  // the rows' match states, their misses overlapped
                const Request& r = *reqs[lookups_[n]];
                r.index->prefetch_state(r.ls.match.state);
                if (global && r.ls.global_serial == global->serial) global->prefetch_state(r.ls.global_match.state);
            }
            for (size_t n = begin; n < end; ++n) {
                const int32_t i = lookups_[n];
                Request& r = *reqs[i];
                sources_of(r.index, r, nullptr, 0, r.ls, global, sources[n - begin]);
                row_ks.push_back(ks[i]);
                outs.push_back(&drafts_[i]);
            }
            chains(sources, row_ks.data(), outs.data(), end - begin, config_.chain);
        });
        timings_["step_lookup_ns"] += now_ns() - committed_at;
        if (follow_)
            for (size_t i = 0; i < rows; ++i)
                if (ks[i] > 0 && !reqs[i]->following) {
                    Request& r = *reqs[i];
                    if (drafts_[i].tokens.empty()) {  // DraftFollower.offer: its forward commits one token
                        followed_drafts_ += 1;
                        continue;
                    }
                    r.following = true;
                    r.follow_tokens = drafts_[i].tokens;
                    r.follow_probs = drafts_[i].probs;
                    follow_stride_ = std::max(follow_stride_, r.follow_probs.size());
                    r.follow_matched = 0;
                }
        timings_["step_ns"] += now_ns() - begin;
        timings_["step_rows"] += static_cast<int64_t>(rows);
        timings_["resumed_lookups"] += std::count(resumed_.begin(), resumed_.end(), uint8_t{1});
    }

    std::pair<int64_t, int64_t> followed() {
        join();
        return {followed_drafts_, followed_accepted_};
    }

    std::map<std::string, int64_t> timings() {
        join();
        return timings_;
    }

    py::tuple step_result() const {
        const size_t rows = drafts_.size();
        size_t total = 0;
        for (const auto& d : drafts_) total += d.tokens.size();
        py::array_t<int32_t> tokens(static_cast<py::ssize_t>(total));
        py::array_t<int64_t> offsets(static_cast<py::ssize_t>(rows + 1));
        py::array_t<double> probs(static_cast<py::ssize_t>(total));
        py::array_t<int32_t> matched(static_cast<py::ssize_t>(rows));
        py::array_t<int8_t> source(static_cast<py::ssize_t>(rows));
        py::array_t<bool> hit(static_cast<py::ssize_t>(rows));
        int32_t* t = tokens.mutable_data();
        double* p = probs.mutable_data();
        int64_t* o = offsets.mutable_data();
        int32_t* m = matched.mutable_data();
        int8_t* s = source.mutable_data();
        bool* h = hit.mutable_data();
        size_t at = 0;
        o[0] = 0;
        for (size_t i = 0; i < rows; ++i) {
            const DraftOut& d = drafts_[i];
            std::copy(d.tokens.begin(), d.tokens.end(), t + at);
            std::copy(d.probs.begin(), d.probs.end(), p + at);
            at += d.tokens.size();
            o[i + 1] = static_cast<int64_t>(at);
            m[i] = d.matched;
            s[i] = d.source;
            h[i] = hits_[i] != 0;
        }
        return py::make_tuple(tokens, offsets, probs, matched, source, hit);
    }

    // The rows' committed tokens enter their prompts' indexes, in the background.
    // (Queued behind any background work, without waiting for it: requests_ only
    // changes on this thread, so the handles can be resolved here.)
    // ``now``: on the calling thread (and the step's pool) before returning, no background hand-off.
    void absorb(const std::vector<int64_t>& handles, bool now) {
        std::vector<Request*> reqs;
        for (int64_t h : handles) reqs.push_back(&get(h));
        if (now) {
            join();
            const int64_t begin = now_ns();
            absorb_rows(reqs, arrival_order(reqs));
            timings_["absorb_ns"] += now_ns() - begin;
            timings_["absorb_rows"] += static_cast<int64_t>(reqs.size());
            return;
        }
        workers_.submit([this, reqs] { timed_absorb(reqs); });
    }

    void timed_absorb(const std::vector<Request*>& reqs) {
        const int64_t begin = now_ns();
        absorb_rows(reqs, arrival_order(reqs));
        timings_["absorb_ns"] += now_ns() - begin;
        timings_["absorb_rows"] += static_cast<int64_t>(reqs.size());
    }

    // ---- prefetch -------------------------------------------------------------------------

    // ``absorb_first``: rows whose committed tokens enter the index first (absorb, in the same job:
    // one wake-up of the background thread).
    void prefetch(const std::vector<int64_t>& handles, const Tokens& tokens, const std::vector<int64_t>& offsets,
                  const std::vector<double>& probs, int32_t k, const std::vector<int64_t>& absorb_first) {
        check_rows(handles.size(), tokens.size(), offsets);
        if (probs.size() != tokens.size())
            throw py::value_error(std::to_string(probs.size()) + " probabilities for " + std::to_string(tokens.size()) +
                                  " draft tokens");
        if (k < 0) throw py::value_error("k must be >= 0, got " + std::to_string(k));
        check_tokens(tokens, "draft tokens");
        check_probabilities(probs);
        std::vector<Request*> reqs = rows_of(handles), first;
        for (int64_t h : absorb_first) first.push_back(&get(h));
        span_open_ = true;
        workers_.submit([this, reqs, first, tokens, offsets, probs, k, called = now_ns()] {
            span_ = Span{called, 0, -1, 0};
            if (!first.empty()) timed_absorb(first);
            cache_.reset(0);
            outcomes_.clear();
            ++prefetches_;
            run_prefetch(reqs, tokens, offsets, probs, k);
            span_.ended_ns = now_ns();
        });
    }

    // The per-request budget in effect (``limit``: the most outcomes one request gets;
    // ``shared_budget``: the batch's total per planned request, -1 without one). The next prefetch
    // plans without a floor: the last cut was another budget's.
    void set_budget(int32_t limit, int64_t shared_budget) {
        join();
        prefetch_.allocate.budget = limit;
        prefetch_.shared_budget = shared_budget;
        last_cut_ = 0.0;
    }

    // The last prefetch that a cancelling stop ended, once: (outcomes chosen, -1 where the
    // cancel came during the planning; outcomes looked up; ns from the call to the work's end;
    // ns from the call to the stop), or None.
    py::object take_span() {
        if (!span_report_) return py::none();
        span_report_ = false;
        return py::make_tuple(reported_.chosen, reported_.done, reported_.ended_ns - reported_.begun_ns,
                              stopped_ns_ - reported_.begun_ns);
    }

    // Wait at most ``seconds`` for the background work (a forward's length); whether it finished.
    bool wait_idle(double seconds) { return workers_.wait_for(seconds); }

    // Stop (cancel: the prefetch lookups not yet started are dropped) or finish the background work.
    void stop(bool cancel) {
        const int64_t called = now_ns();  // the forward's end: the time the prefetch had
        if (cancel) cancel_.store(true);
        join();
        cancel_.store(false);
        if (span_open_ && cancel) {
            reported_ = span_;
            stopped_ns_ = called;
            span_report_ = true;
        }
        span_open_ = false;
        if (cancel) workers_.rouse();  // the forward has ended: the step's run comes next
    }

    // stop, then the outcomes the last prefetch looked up (as arrays: a cost the engine's step
    // does not pay, it only needs the prefetched drafts, which the next step finds by itself).
    py::tuple collect(bool cancel) {
        {
            py::gil_scoped_release release;
            stop(cancel);
        }
        std::vector<int32_t> rows, accepted, token;
        std::vector<double> probability;
        std::vector<int32_t> dtokens, dmatched;
        std::vector<int64_t> doffsets{0};
        std::vector<double> dprobs;
        std::vector<int8_t> dsource;
        for (const auto& o : outcomes_) {
            rows.push_back(o.row);
            accepted.push_back(o.outcome.accepted);
            token.push_back(o.outcome.token);
            probability.push_back(o.outcome.probability);
            dtokens.insert(dtokens.end(), o.draft.tokens.begin(), o.draft.tokens.end());
            dprobs.insert(dprobs.end(), o.draft.probs.begin(), o.draft.probs.end());
            doffsets.push_back(static_cast<int64_t>(dtokens.size()));
            dmatched.push_back(o.draft.matched);
            dsource.push_back(o.draft.source);
        }
        return py::make_tuple(to_array(rows), to_array(accepted), to_array(token), to_array(probability),
                              to_array(dtokens), to_array(doffsets), to_array(dprobs), to_array(dmatched),
                              to_array(dsource));
    }

    // ---- calibration ----------------------------------------------------------------------

    void observe(const std::vector<double>& probs, const std::vector<int64_t>& offsets,
                 const std::vector<int64_t>& accepted) {
        check_estimates(probs, offsets);
        if (accepted.size() + 1 != offsets.size())
            throw py::value_error("accepted has " + std::to_string(accepted.size()) + " entries for " +
                                  std::to_string(offsets.size() - 1) + " drafts");
        for (size_t i = 0; i < accepted.size(); ++i)
            if (accepted[i] < 0)
                throw py::value_error("accepted[" + std::to_string(i) + "] = " + std::to_string(accepted[i]) +
                                      " is negative");
        join();
        for (size_t i = 0; i + 1 < offsets.size(); ++i)
            calibration_.observe(probs.data() + offsets[i], static_cast<int>(offsets[i + 1] - offsets[i]),
                                 static_cast<int>(accepted[i]));
    }

    std::vector<double> chances(const std::vector<double>& probs, const std::vector<int64_t>& offsets) {
        check_estimates(probs, offsets);
        join();
        std::vector<double> out(probs.size());
        for (size_t i = 0; i + 1 < offsets.size(); ++i)
            for (int64_t j = offsets[i]; j < offsets[i + 1]; ++j)
                out[j] = calibration_.chance(static_cast<int>(j - offsets[i]), probs[j]);
        return out;
    }

    LengthChoice lengths(const std::vector<double>& probs, const std::vector<int64_t>& offsets, double scale,
                         const std::vector<double>& coefficients, double min_gain, bool adaptive, int32_t probe_tokens) {
        check_estimates(probs, offsets);
        join();
        LengthChoice out;
        if (coefficients.size() != 5) throw std::invalid_argument("a step-cost fit has 5 values");
        const double c[5] = {coefficients[0], coefficients[1], coefficients[2], coefficients[3], coefficients[4]};
        choose_lengths(calibration_, probs.data(), offsets.data(), offsets.size() - 1, scale, c, min_gain, adaptive,
                       probe_tokens, out);
        return out;
    }

    std::vector<std::vector<double>> calibration_state() {
        join();
        return calibration_.state();
    }

    void load_calibration_state(const std::vector<std::vector<double>>& state) {
        join();
        calibration_.load_state(state);
    }

    // ---- the pool's stateless lookup ------------------------------------------------------

    // The first m continuations of the state ``output`` reaches in the prompt's index, as the
    // outcome model ranks them (the index's cached ranking head where it keeps one).
    std::vector<std::pair<int32_t, int32_t>> continuations(const std::string& id, const Tokens& prompt,
                                                           const Tokens& output, int32_t m) {
        if (m < 0) throw py::value_error("continuations: m must be >= 0, got " + std::to_string(m));
        std::vector<std::pair<int32_t, int32_t>> out;
        py::gil_scoped_release release;
        join();
        Prompt* entry = history_.find(id);
        if (entry == nullptr) return out;
        const Automaton* index = history_.indexed(entry);
        Tokens seq;
        history_.sequence(prompt, output.data(), output.size(), seq);
        index->ranked(index->advance(Match{}, seq.data(), seq.size()).state, static_cast<size_t>(m), out);
        return out;
    }

    py::tuple lookup_context(const std::string& id, const Tokens& prompt, const Tokens& output, int32_t k) {
        DraftOut out;
        {
            py::gil_scoped_release release;
            join();
            Prompt* entry = history_.find(id);
            if (entry != nullptr) {
                Automaton* index = history_.indexed(entry);
                Request r;
                r.handle = -1;
                r.prompt_id = id;
                r.prompt = prompt;
                r.output = output;
                r.known = true;
                r.entry = entry;
                r.index = index;
                r.index_serial = index->serial;
                r.layout = history_.layout;
                Tokens seq;
                history_.sequence(prompt, output.data(), output.size(), seq);
                r.ls.match = index->advance(Match{}, seq.data(), seq.size());
                if (k > 0) {
                    Automaton* global = config_.use_global ? history_.global_index() : nullptr;
                    lookup_from(index, r, nullptr, 0, r.ls, k, global, out);
                }
            }
        }
        return py::make_tuple(py::cast(out.tokens), py::cast(out.probs), out.matched, out.source);
    }

private:
    History history_;
    const DrafterConfig config_;
    PrefetchConfig prefetch_;  // its budget changes only in set_budget, with no background work running
    const bool follow_;  // calibrate from every draft by following the committed tokens (DraftFollower)
    int64_t followed_drafts_ = 0, followed_accepted_ = 0;
    // A step's settled drafts (follow_row): per row the accepted count (-1: none settled) and the
    // cells observed, follow_stride_ (the longest draft followed) apart.
    std::vector<int32_t> follow_accepted_, follow_upto_;
    std::vector<uint8_t> follow_cells_;
    size_t follow_stride_ = 0;
    uint64_t checked_calls_ = 0;  // calls whose rows rows_of checked (each request notes the last that named it)
    Calibration calibration_;
    std::deque<std::unique_ptr<Request>> requests_;  // the request of handle first_handle_ + i at i
    int64_t first_handle_ = 0;
    std::vector<DraftOut> drafts_;
    std::vector<uint8_t> hits_, resumed_;
    std::vector<int32_t> lookups_;
    // The match states a prefetched lookup drafted from (its catch-up over the outcome's tokens).
    struct LookedFrom {
        Match prompt, global;
        Automaton* global_index = nullptr;
    };
    struct Prefetched {
        int32_t row;
        OutcomeOut outcome;
        DraftOut draft;
        Stamp stamp;  // what its lookup read
        LookedFrom from;
    };
    std::vector<uint8_t> wants_lookup_, done_;  // a step's rows: still to look up; committed already
    OutcomeTable cache_;  // -> index into outcomes_
    bool cache_valid_ = false;  // the last prefetch's, not used by a step yet
    uint64_t prefetches_ = 0;   // prefetches run (the generation of Walked states)
    double last_cut_ = 0.0;     // the last prefetch's cut (outcome.budget_cut)
    // A batch-budget prefetch's outcomes per row before and after the allocation: kept from one
    // prefetch to the next (one runs at a time) so that the rows' lists keep their memory.
    std::vector<std::vector<OutcomeOut>> plan_candidates_, plan_chosen_;
    // A prefetch's span: when it was called and its work ended, its outcomes chosen (-1: cancelled
    // in the planning) and looked up; written by its job (jobs run in order), read after a join.
    struct Span {
        int64_t begun_ns, ended_ns, chosen, done;
    };
    Span span_{0, 0, -1, 0}, reported_{0, 0, -1, 0};
    bool span_open_ = false, span_report_ = false;
    int64_t stopped_ns_ = 0;
    std::vector<Prefetched> outcomes_;
    std::atomic<bool> cancel_{false};
    // Time spent in each kind of work since the core was made (ns), and the rows it covered.
    std::map<std::string, int64_t> timings_{{"step_ns", 0},         {"step_rows", 0},     {"absorb_ns", 0},
                                            {"absorb_rows", 0},     {"plan_ns", 0},       {"plan_rows", 0},
                                            {"prefetch_lookup_ns", 0}, {"prefetch_lookups", 0},
                                            {"resumed_lookups", 0}, {"step_wait_ns", 0},
                                            {"step_absorb_ns", 0},  {"step_commit_ns", 0},
                                            {"step_lookup_ns", 0},  {"step_lookups", 0}};
    Workers workers_;  // last: joined before the members its jobs use are destroyed

    void join() { workers_.wait(); }

    // DraftFollower.committed for row i: its followed draft against the tokens it committed. Where they
    // settle how much of the draft was accepted, the calibration cells it observes are noted for
    // observe_followed (rows commit on any thread; the calibration's decay makes the order count).
    void follow_row(Request& r, size_t i, const int32_t* tokens, size_t n) {
        if (!r.following) return;
        int32_t matched = r.follow_matched;
        bool resolved = false;
        for (size_t t = 0; t < n; ++t) {
            if (tokens[t] != r.follow_tokens[matched]) {
                resolved = true;
                break;
            }
            matched += 1;
            if (matched == static_cast<int32_t>(r.follow_tokens.size())) {
                resolved = true;
                break;
            }
        }
        if (!resolved) {
            r.follow_matched = matched;
            return;
        }
        r.following = false;
        const int upto = std::min(static_cast<int>(r.follow_probs.size()), matched + 1);
        uint8_t* cells = follow_cells_.data() + i * follow_stride_;
        for (int position = 0; position < upto; ++position)
            cells[position] = Calibration::cell_of(position, r.follow_probs[position]);
        follow_upto_[i] = upto;
        follow_accepted_[i] = matched;
    }

    // The drafts the step's rows settled, into the calibration in arrival order.
    void observe_followed(const std::vector<size_t>& order) {
        for (const size_t i : order) {
            const int32_t accepted = follow_accepted_[i];
            if (accepted < 0) continue;
            calibration_.observe_cells(follow_cells_.data() + i * follow_stride_, follow_upto_[i], accepted);
            followed_drafts_ += 1;
            followed_accepted_ += accepted;
        }
    }

    static int64_t now_ns() {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(
                   std::chrono::steady_clock::now().time_since_epoch()).count();
    }

    // A call's rows, checked before anything changes: offsets that rise from 0 to the tokens given.
    static void check_rows(size_t rows, size_t tokens, const std::vector<int64_t>& offsets,
                           const char* what = "tokens") {
        if (offsets.size() != rows + 1)
            throw py::value_error("offsets has " + std::to_string(offsets.size()) + " entries; " +
                                  std::to_string(rows) + " rows need " + std::to_string(rows + 1));
        if (rows == 0) return;
        bool rising = offsets[0] == 0 && offsets[rows] == static_cast<int64_t>(tokens);
        for (size_t i = 0; rising && i < rows; ++i) rising = offsets[i + 1] >= offsets[i];
        if (!rising)
            throw py::value_error("offsets must rise from 0 to the " + std::to_string(tokens) + " " + what + " given");
    }

    // Token ids are >= 0 (the automaton takes a negative one for "no continuation").
    static void check_tokens(const Tokens& tokens, const char* what) {
        int32_t lowest = 0;
        for (const int32_t token : tokens) lowest = std::min(lowest, token);
        if (lowest >= 0) return;
        for (size_t i = 0; i < tokens.size(); ++i)
            if (tokens[i] < 0)
                throw py::value_error(std::string(what) + "[" + std::to_string(i) + "] = " +
                                      std::to_string(tokens[i]) + " is negative (token ids are >= 0)");
    }

    static bool all_probabilities(const std::vector<double>& probs) {
        const double* p = probs.data();
        const size_t n = probs.size();
        size_t i = 0;
        bool ok = true;
#if defined(__SSE2__)
        // Two lanes at a time, two chains: a step's thousands of estimates in about a microsecond
        // (the compiler keeps a scalar loop of compares, about three times that).
        const __m128d zero = _mm_setzero_pd(), one = _mm_set1_pd(1.0);
        __m128d a = _mm_cmpeq_pd(zero, zero), b = a;
        for (; i + 4 <= n; i += 4) {
            const __m128d x = _mm_loadu_pd(p + i), y = _mm_loadu_pd(p + i + 2);
            a = _mm_and_pd(a, _mm_and_pd(_mm_cmpge_pd(x, zero), _mm_cmple_pd(x, one)));  // NaN fails both
            b = _mm_and_pd(b, _mm_and_pd(_mm_cmpge_pd(y, zero), _mm_cmple_pd(y, one)));
        }
        ok = _mm_movemask_pd(_mm_and_pd(a, b)) == 3;
#endif
        for (; i < n; ++i) ok &= p[i] >= 0.0 && p[i] <= 1.0;
        return ok;
    }

    static void check_probabilities(const std::vector<double>& probs) {
        if (all_probabilities(probs)) return;
        for (size_t i = 0; i < probs.size(); ++i)
            if (!(probs[i] >= 0.0 && probs[i] <= 1.0))
                throw py::value_error("estimates[" + std::to_string(i) + "] = " + std::to_string(probs[i]) +
                                      " is not a probability in [0, 1]");
    }

    // Drafts' estimates, flat, and the offsets of each draft's (rows + 1 entries).
    static void check_estimates(const std::vector<double>& probs, const std::vector<int64_t>& offsets) {
        if (offsets.empty()) throw py::value_error("offsets needs rows + 1 entries, got none");
        check_rows(offsets.size() - 1, probs.size(), offsets, "estimates");
        if (offsets.size() == 1 && !probs.empty())
            throw py::value_error("offsets must rise from 0 to the " + std::to_string(probs.size()) + " estimates given");
        check_probabilities(probs);
    }

    // The live requests the handles name, each at most once.
    std::vector<Request*> rows_of(const std::vector<int64_t>& handles) {
        const uint64_t call = ++checked_calls_;
        std::vector<Request*> reqs(handles.size());
        for (size_t i = 0; i < handles.size(); ++i) {
            Request& r = get(handles[i]);
            if (r.seen_in_call == call) throw py::value_error("a request handle appears twice in one step");
            r.seen_in_call = call;
            reqs[i] = &r;
        }
        return reqs;
    }

    Request& get(int64_t handle) {
        const int64_t at = handle - first_handle_;
        if (at < 0 || at >= static_cast<int64_t>(requests_.size()) || !requests_[at])
            throw py::value_error("request handle " + std::to_string(handle) + " is not a live request of this core");
        return *requests_[at];
    }

    static void truncate(DraftOut& d, int32_t k) {
        if (static_cast<int32_t>(d.tokens.size()) > k) {
            d.tokens.resize(k);
            d.probs.resize(k);
        }
    }

    Stamp stamp(const Request& r) const {
        const Automaton* built = history_.built_global();
        return Stamp{history_.layout, r.index ? r.index->serial : 0, r.index ? r.index->num_tokens : -1,
                     built ? built->serial : 0, built ? built->num_tokens : -1};
    }

    // NgramDrafter.holds_current_index: no prompt left since the request found its own (so
    // ``entry`` is alive), and its prompt's index is the one it holds (not dropped and rebuilt,
    // possibly at the same address: the serial tells).
    bool holds_current_index(const Request& r) const {
        return r.layout == history_.layout && r.index && r.entry && r.entry->index.get() == r.index &&
               r.index->serial == r.index_serial;
    }

    // NgramDrafter.index
    Automaton* index(Request& r) {
        if (holds_current_index(r)) return r.index;
        r.layout = history_.layout;
        Prompt* entry = history_.find(r.prompt_id);
        r.entry = entry;
        Automaton* idx = entry ? history_.indexed(entry) : nullptr;
        LiveSequence* live = entry ? entry->find_live(r.handle) : nullptr;
        if (idx == nullptr || live == nullptr) {
            r.known = false;
            r.index = nullptr;
            r.index_serial = 0;
            return nullptr;
        }
        if (idx->serial != r.index_serial) hold(r, idx, *live);
        return idx;
    }

    // NgramDrafter._hold: the request takes ``idx``, its prompt's index where it is ``live``.
    void hold(Request& r, Automaton* idx, const LiveSequence& live) {
        r.index = idx;
        r.index_serial = idx->serial;
        r.ls.match = idx->advance(Match{live.cursor, (*idx)[live.cursor].length}, r.pending.data(), r.pending.size());
        r.ls.behind.clear();
    }

    // NgramDrafter.commit (the absorb it starts with has nothing to do after the step's absorb)
    void commit(Request& r, const Tokens& tokens) {
        r.output.insert(r.output.end(), tokens.begin(), tokens.end());
        if (!r.known) return;
        absorb_one(r);
        if (index(r) == nullptr) return;
        r.pending = tokens;
        r.ls.behind = tokens;
        if (r.ls.global) r.ls.global_behind.insert(r.ls.global_behind.end(), tokens.begin(), tokens.end());
    }

    // ReferenceCore's take_match_states: a row served a prefetched draft takes the states its
    // lookup caught up to (the indexes are unchanged since: the stamp), as its own lookup would
    // leave them; left behind, a run of hits would re-match the cross-prompt index from the recent
    // context past rematch_tokens, and later drafts would depend on which steps hit.
    void take_match_states(Request& r, const LookedFrom& from) const {
        r.ls.match = from.prompt;
        r.ls.behind.clear();
        if (config_.use_global) {
            r.ls.global = from.global_index;
            r.ls.global_serial = from.global_index->serial;
            r.ls.global_match = from.global;
            r.ls.global_behind.clear();
        }
    }

    // NgramDrafter.defer
    void defer(Request& r, const Tokens& tokens) {
        r.output.insert(r.output.end(), tokens.begin(), tokens.end());
        if (!r.known) return;
        r.pending.insert(r.pending.end(), tokens.begin(), tokens.end());
        r.ls.behind.insert(r.ls.behind.end(), tokens.begin(), tokens.end());
        if (r.ls.global) r.ls.global_behind.insert(r.ls.global_behind.end(), tokens.begin(), tokens.end());
    }

    // NgramDrafter.absorb, the part after the entry was found and touched. (Rows of one prompt
    // run on one thread; the layout does not move while rows absorb.)
    void absorb_into(Request& r, Prompt* entry) {
        history_.extend_live(entry, r.handle, r.pending);
        r.pending.clear();  // keeps its buffer for the next step's tokens
        if (entry == nullptr) return;
        Automaton* idx = history_.ensure_index(entry);
        LiveSequence* live = entry->find_live(r.handle);
        if (live == nullptr) return;
        r.entry = entry;
        r.layout = history_.layout;
        hold(r, idx, *live);
    }

    void absorb_one(Request& r) {
        if (!r.known || r.pending.empty()) return;
        Prompt* entry = history_.find(r.prompt_id);
        if (entry) history_.touch(entry);
        absorb_into(r, entry);
    }

    // The rows in the order their requests started (handles rise with it). Whatever changes the
    // history goes in this order, so a step's drafts do not depend on the order of its rows (an
    // engine's batch order is its own: vLLM moves rows when requests finish).
    static std::vector<size_t> arrival_order(const std::vector<Request*>& reqs) {
        std::vector<size_t> order(reqs.size());
        std::iota(order.begin(), order.end(), size_t{0});
        const auto earlier = [&](size_t a, size_t b) { return reqs[a]->handle < reqs[b]->handle; };
        if (!std::is_sorted(order.begin(), order.end(), earlier)) std::sort(order.begin(), order.end(), earlier);
        return order;
    }

    // absorb for many rows (``order``: their arrival_order): in arrival order within a prompt,
    // prompts in parallel.
    void absorb_rows(const std::vector<Request*>& reqs, const std::vector<size_t>& order) {
        std::vector<std::pair<Prompt*, std::vector<Request*>>> groups;
        std::unordered_map<Prompt*, size_t> group_of;
        for (const size_t i : order) {
            Request* r = reqs[i];
            if (!r->known || r->pending.empty()) continue;
            Prompt* entry = history_.find(r->prompt_id);
            if (entry == nullptr) {
                r->pending.clear();
                continue;
            }
            history_.touch(entry);
            auto it = group_of.find(entry);
            if (it == group_of.end()) {
                group_of.emplace(entry, groups.size());
                groups.push_back({entry, {r}});
            } else {
                groups[it->second].second.push_back(r);
            }
        }
        workers_.run(groups.size(), [&](size_t g) {
            for (Request* r : groups[g].second) absorb_into(*r, groups[g].first);
        });
    }

    // Whether the request's index is the one index() would return without looking (nothing shared
    // is read or changed to commit it).
    bool current(const Request& r) const {
        return !r.known || (holds_current_index(r) && r.pending.empty());
    }

    // After the forward every request is a few cache misses, each found through the one before (the
    // request, its buffers, its prefetched outcome): the commits hint the request two rows ahead
    // and what it points to one row ahead, so different rows' misses overlap.
    static void hint_request(const Request& r) {
        const char* at = reinterpret_cast<const char*>(&r);
        for (size_t line = 0; line < sizeof(Request); line += 64) __builtin_prefetch(at + line);
    }

    void hint_commit(const Request& r, size_t i, const Tokens& tokens, const std::vector<int64_t>& offsets) const {
        if (cache_valid_ && offsets[i + 1] > offsets[i])
            cache_.hint(committed_outcome(r.handle, tokens.data() + offsets[i],
                                          static_cast<size_t>(offsets[i + 1] - offsets[i])));
        if (!r.output.empty()) __builtin_prefetch(r.output.data() + r.output.size() - 1, 1);
        __builtin_prefetch(r.pending.data(), 1);
        __builtin_prefetch(r.ls.behind.data(), 1);
        __builtin_prefetch(r.ls.global_behind.data(), 1);
        __builtin_prefetch(r.follow_tokens.data());
        __builtin_prefetch(r.follow_probs.data());
        __builtin_prefetch(r.walked.draft.data());
        __builtin_prefetch(r.entry);
        __builtin_prefetch(r.index);
    }

    // Row i's part of a step: commit (or defer) its tokens, take its prefetched draft if there is
    // one, else mark it in wants_lookup_.
    void commit_row(Request& r, size_t i, const Tokens& tokens, const std::vector<int64_t>& offsets, int32_t k,
                    Tokens& committed) {
        if (follow_) follow_row(r, i, tokens.data() + offsets[i], static_cast<size_t>(offsets[i + 1] - offsets[i]));
        committed.assign(tokens.begin() + offsets[i], tokens.begin() + offsets[i + 1]);
        drafts_[i].clear();
        if (k <= 0) {
            defer(r, committed);
            return;
        }
        commit(r, committed);
        if (cache_valid_ && !committed.empty() && r.known) {
            const int32_t at = cache_.find(committed_outcome(r.handle, committed.data(), committed.size()));
            if (at >= 0 && outcomes_[at].stamp == stamp(r)) {
                drafts_[i] = outcomes_[at].draft;
                truncate(drafts_[i], k);
                hits_[i] = 1;
                take_match_states(r, outcomes_[at].from);
                return;
            }
        }
        wants_lookup_[i] = r.known;
        // Resumed in the lookup phase, where the rows' cache misses overlap (nothing a later row
        // commits changes what this one reads).
        if (r.known && resumes(r, committed)) resumed_[i] = 1;
    }

    // Whether a row that missed committed an outcome whose match states the last prefetch walked,
    // from the match states it still has, over the indexes they read.
    bool resumes(const Request& r, const Tokens& committed) const {
        const Walked& w = r.walked;
        if (!cache_valid_ || w.generation != prefetches_ || committed.empty()) return false;
        const size_t j = committed.size() - 1;
        return j < w.prompt_chain.size() && r.ls.match == w.from && r.ls.behind.size() == committed.size() &&
               std::equal(committed.begin(), committed.begin() + j, w.draft.begin()) && w.stamp == stamp(r);
    }

    // catch_up's result from the walked states (the cross-prompt one only where catch_up would
    // advance rather than re-match the recent context).
    void resume(Request& r, size_t j, int32_t b) {
        const Walked& w = r.walked;
        r.ls.match = r.index->step(w.prompt_chain[j], b);
        r.ls.behind.clear();
        Automaton* global = history_.built_global();
        if (resumes_global(r, j, global)) {
            r.ls.global_match = global->step(w.global_chain[j], b);
            r.ls.global_behind.clear();
        }
    }

    // Whether the cross-prompt state resumes too (catch_up would advance it, not re-match).
    bool resumes_global(const Request& r, size_t j, const Automaton* global) const {
        const Walked& w = r.walked;
        return w.global && r.ls.global == global && global && r.ls.global_serial == global->serial &&
               r.ls.global_match == w.global_from && r.ls.global_behind.size() == w.global_behind + j + 1 &&
               static_cast<int32_t>(r.ls.global_behind.size()) <= config_.rematch_tokens;
    }

    // The last ``n`` tokens of prompt + output + extra.
    static void context_tail(const Request& r, const int32_t* extra, size_t n_extra, size_t n, Tokens& out) {
        out.clear();
        const size_t total = r.prompt.size() + r.output.size() + n_extra;
        size_t skip = total > n ? total - n : 0;
        auto take = [&](const int32_t* data, size_t size) {
            if (skip >= size) {
                skip -= size;
                return;
            }
            out.insert(out.end(), data + skip, data + size);
            skip = 0;
        };
        take(r.prompt.data(), r.prompt.size());
        take(r.output.data(), r.output.size());
        take(extra, n_extra);
    }

    // NgramDrafter.catch_up, with ``current_global`` standing for history.global_index()
    // (built by the caller whenever this may ask for it).
    void catch_up(const Automaton* index, const Request& base, const int32_t* extra, size_t n_extra, LookState& ls,
                  Automaton* current_global) const {
        if (!ls.behind.empty()) {
            ls.match = index->advance(ls.match, ls.behind.data(), ls.behind.size());
            ls.behind.clear();
        }
        if (!ls.global_behind.empty() && ls.global) {
            thread_local Tokens behind;  // ls keeps its buffer for the next step's tokens
            behind.assign(ls.global_behind.begin(), ls.global_behind.end());
            ls.global_behind.clear();
            if (current_global == nullptr || ls.global_serial != current_global->serial) {
                ls.global = nullptr;
                ls.global_serial = 0;
            } else if (static_cast<int32_t>(behind.size()) > config_.rematch_tokens) {
                thread_local Tokens tail;
                context_tail(base, extra, n_extra, config_.rematch_tokens, tail);
                ls.global_match = current_global->advance(Match{}, tail.data(), tail.size());
            } else {
                ls.global_match = current_global->advance(ls.global_match, behind.data(), behind.size());
            }
        }
    }

    // NgramDrafter.lookup once the request is known and its index current.
    void lookup_from(const Automaton* index, const Request& base, const int32_t* extra, size_t n_extra, LookState& ls,
                     int32_t k, Automaton* global, DraftOut& out) const {
        thread_local std::vector<SourceMatch> sources;
        sources_of(index, base, extra, n_extra, ls, global, sources);
        chain(sources, k, config_.chain, out);
    }

    // The match states a lookup drafts from (the prompt's index first), caught up.
    void sources_of(const Automaton* index, const Request& base, const int32_t* extra, size_t n_extra, LookState& ls,
                    Automaton* global, std::vector<SourceMatch>& sources) const {
        catch_up(index, base, extra, n_extra, ls, global);
        sources.assign(1, SourceMatch{index, ls.match});
        if (config_.use_global) {
            if (ls.global_serial != global->serial) {
                ls.global = global;
                ls.global_serial = global->serial;
                thread_local Tokens tail;
                context_tail(base, extra, n_extra, config_.rematch_tokens, tail);
                ls.global_match = global->advance(Match{}, tail.data(), tail.size());
            }
            sources.push_back(SourceMatch{global, ls.global_match});
        }
    }

    bool readable(const Request& r) const {
        return r.known && holds_current_index(r) && r.pending.empty();
    }

    // One row's inputs to the outcome model: its match states caught up (ReferenceCore._caught_up)
    // and its draft's calibrated chances.
    struct RowInputs {
        SourceMatch sources[2];
        size_t num_sources = 1;
        std::vector<double> chances;
        std::vector<Match>* walked[2];
    };

    // The outcome model for rows of a prefetch (predict_for each, the rows' cache misses
    // overlapped: OutcomePlanner), each row's draft at [begins[i], ends[i]) of ``tokens``; the
    // match states it walked kept for the next step's lookup (Walked). Reads the indexes only.
    void predict_rows(Request* const* reqs, const int64_t* begins, const int64_t* ends, size_t n, const Tokens& tokens,
                      const std::vector<double>& probs, Automaton* global, double floor,
                      std::vector<OutcomeOut>* outs) const {
        thread_local std::vector<RowInputs> inputs;
        thread_local std::vector<OutcomeQuery> queries;
        thread_local OutcomePlanner planner;
        if (inputs.size() < n) inputs.resize(n);
        queries.clear();
        for (size_t i = 0; i < n; ++i) {
            Request& r = *reqs[i];
            RowInputs& in = inputs[i];
            catch_up_probe(r, global, in);
            const int32_t length = static_cast<int32_t>(ends[i] - begins[i]);
            in.chances.resize(length);
            for (int32_t j = 0; j < length; ++j) in.chances[j] = calibration_.chance(j, probs[begins[i] + j]);
            r.walked.generation = 0;
            in.walked[0] = &r.walked.prompt_chain;
            in.walked[1] = &r.walked.global_chain;
            queries.push_back(OutcomeQuery{in.sources, in.num_sources, tokens.data() + begins[i], length,
                                           in.chances.data(), &outs[i], in.walked});
        }
        planner.predict(queries.data(), n, prefetch_.allocate.budget, prefetch_.levels, floor);
        for (size_t i = 0; i < n; ++i) {
            Request& r = *reqs[i];
            if (!r.ls.behind.empty()) continue;  // the next commit replaces what the walk started from
            Walked& w = r.walked;
            w.generation = prefetches_;
            w.stamp = stamp(r);
            w.from = r.ls.match;
            // The cross-prompt chain resumes what catch_up would advance, not what it would re-match.
            w.global = inputs[i].num_sources == 2 &&
                       static_cast<int32_t>(r.ls.global_behind.size()) <= config_.rematch_tokens;
            w.global_from = r.ls.global_match;
            w.global_behind = r.ls.global_behind.size();
            w.draft.assign(tokens.begin() + begins[i], tokens.begin() + ends[i]);
            if (!w.global) w.global_chain.clear();
        }
    }

    // The row's match states with its pending tokens read (ReferenceCore._caught_up), as sources.
    void catch_up_probe(const Request& r, Automaton* global, RowInputs& in) const {
        LookState probe;
        probe.match = r.ls.match;
        if (!r.ls.behind.empty()) probe.match = r.index->advance(probe.match, r.ls.behind.data(), r.ls.behind.size());
        probe.global = r.ls.global;
        probe.global_serial = r.ls.global_serial;
        probe.global_match = r.ls.global_match;
        if (!r.ls.global_behind.empty() && r.ls.global) {
            if (global == nullptr || r.ls.global_serial != global->serial) {
                probe.global = nullptr;
            } else if (static_cast<int32_t>(r.ls.global_behind.size()) > config_.rematch_tokens) {
                Tokens tail;
                context_tail(r, nullptr, 0, config_.rematch_tokens, tail);
                probe.global_match = global->advance(Match{}, tail.data(), tail.size());
            } else {
                probe.global_match = global->advance(probe.global_match, r.ls.global_behind.data(),
                                                     r.ls.global_behind.size());
            }
        }
        in.sources[0] = SourceMatch{r.index, probe.match};
        in.num_sources = 1;
        if (config_.use_global && probe.global && global && probe.global_serial == global->serial)
            in.sources[in.num_sources++] = SourceMatch{global, probe.global_match};
    }

    // An outcome to look up: the next draft of ``request`` if it commits the first j tokens of its
    // draft (at ``begin`` in the prefetch's tokens) and then b.
    struct OutcomeLookup {
        const Request* request;
        int64_t begin;
        OutcomeOut outcome;
    };

    // The tokens a row commits at ``outcome`` (its draft's first j, then b) and the match state
    // that would follow them, for a lookup that changes nothing.
    static void outcome_probe(const Request& r, const Tokens& tokens, int64_t begin, const OutcomeOut& outcome,
                              Tokens& after, LookState& probe) {
        after.assign(tokens.begin() + begin, tokens.begin() + begin + outcome.accepted);
        after.push_back(outcome.token);
        probe = r.ls;
        probe.behind = after;
        if (r.ls.global) probe.global_behind.insert(probe.global_behind.end(), after.begin(), after.end());
    }

    // The drafts the next step makes for several outcomes (ReferenceCore._committed), drafted
    // together so that their cache misses overlap.
    void lookup_outcomes(const OutcomeLookup* items, size_t n, const Tokens& tokens, int32_t k, Automaton* global,
                         DraftOut* const* outs, LookedFrom* const* froms) const {
        thread_local std::vector<std::vector<SourceMatch>> sources;
        thread_local std::vector<int32_t> ks;
        thread_local Tokens after;
        thread_local LookState probe;
        sources.resize(n);
        ks.assign(n, k);
        for (size_t i = 0; i < n; ++i) {
            const Request& r = *items[i].request;
            if (walked_sources(r, items[i].outcome, global, sources[i])) continue;
            outcome_probe(r, tokens, items[i].begin, items[i].outcome, after, probe);
            sources_of(r.index, r, after.data(), after.size(), probe, global, sources[i]);
        }
        for (size_t i = 0; i < n; ++i)
            *froms[i] = LookedFrom{sources[i][0].match, sources[i].size() > 1 ? sources[i][1].match : Match{}, global};
        chains(sources, ks.data(), outs, n, config_.chain);
    }

    // The match states after an outcome (j, b) of this prefetch, one step by b from those the
    // outcome model walked after d_1..d_j: what catching up over d_1..d_j + [b] from the request's
    // states gives (Automaton::step token by token), without re-reading the tokens the request
    // committed since its last lookup, which every outcome of the row would read again. Where the
    // walk does not stand for that catch-up (not walked, or the cross-prompt state re-matched
    // rather than advanced), false.
    bool walked_sources(const Request& r, const OutcomeOut& outcome, Automaton* global,
                        std::vector<SourceMatch>& sources) const {
        const Walked& w = r.walked;
        const size_t j = static_cast<size_t>(outcome.accepted);
        if (w.generation != prefetches_ || j >= w.prompt_chain.size() || !r.ls.behind.empty() || !(r.ls.match == w.from))
            return false;
        if (config_.use_global &&
            !(w.global && j < w.global_chain.size() && global && r.ls.global == global &&
              r.ls.global_serial == global->serial && r.ls.global_match == w.global_from &&
              r.ls.global_behind.size() == w.global_behind &&
              static_cast<int32_t>(w.global_behind + j + 1) <= config_.rematch_tokens))
            return false;
        sources.assign(1, SourceMatch{r.index, r.index->step(w.prompt_chain[j], outcome.token)});
        if (config_.use_global) sources.push_back(SourceMatch{global, global->step(w.global_chain[j], outcome.token)});
        return true;
    }

    void run_prefetch(const std::vector<Request*>& reqs, const Tokens& tokens, const std::vector<int64_t>& offsets,
                      const std::vector<double>& probs, int32_t k) {
        AllocateConfig alloc = prefetch_.allocate;
        Automaton* global = history_.built_global();
        const double floor = prefetch_.plan_floor * last_cut_;
        last_cut_ = 0.0;  // until this prefetch has allocated a batch's total (a cancelled one has no cut)
        span_.chosen = 0;
        if (alloc.budget <= 0 || (config_.use_global && global == nullptr)) return;
        std::vector<int32_t> rows;
        for (size_t i = 0; i < reqs.size(); ++i)
            if (readable(*reqs[i])) rows.push_back(static_cast<int32_t>(i));  // empty drafts too: b is the next token
        if (prefetch_.shared_budget >= 0) alloc.global_budget = prefetch_.shared_budget * static_cast<int64_t>(rows.size());
        std::vector<std::vector<Prefetched>> found(rows.size());
        std::atomic<int64_t> plan_ns{0}, lookup_ns{0}, planned{0};
        if (alloc.global_budget < 0) {
            // Budgets per request only. Each row is planned and looks up its likeliest kFirst outcomes
            // in one task, while its states are in the cache; the rows' other outcomes run after
            // every row's first ones, a row at a time, the likeliest rows first. The next step
            // cancels what the forward left no time for (waiting for one group at most).
            constexpr size_t kGroup = 4;   // lookups of one row drafted together, their cache misses overlapped
            constexpr size_t kFirst = 16;  // lookups a row makes before any row makes more
            std::vector<std::vector<OutcomeOut>> chosen(rows.size());
            std::vector<size_t> looked(rows.size(), 0);  // per row: its outcomes looked up, likeliest first
            auto look = [&](size_t n, size_t begin, size_t end) {
                OutcomeLookup items[kGroup]{};
                DraftOut* outs[kGroup]{};
                LookedFrom* froms[kGroup]{};
                for (size_t g = begin; g < end; g += kGroup) {
                    if (cancel_.load(std::memory_order_relaxed)) return;
                    const size_t size = std::min(kGroup, end - g);
                    for (size_t i = 0; i < size; ++i) {
                        items[i] = OutcomeLookup{reqs[rows[n]], offsets[rows[n]], chosen[n][g + i]};
                        outs[i] = &found[n][g + i].draft;
                        froms[i] = &found[n][g + i].from;
                    }
                    lookup_outcomes(items, size, tokens, k, global, outs, froms);
                    looked[n] = g + size;
                }
            };
            workers_.run(rows.size(), [&](size_t n) {
                if (cancel_.load(std::memory_order_relaxed)) return;
                const int64_t t0 = now_ns();
                Request* r = reqs[rows[n]];
                std::vector<std::vector<OutcomeOut>> candidates(1), mine;
                predict_rows(&r, &offsets[rows[n]], &offsets[rows[n] + 1], 1, tokens, probs, global, 0.0,
                             candidates.data());
                allocate(candidates, {r->handle}, alloc, mine);
                chosen[n] = std::move(mine[0]);
                const int64_t t1 = now_ns();
                found[n].reserve(chosen[n].size());
                for (const OutcomeOut& o : chosen[n]) found[n].push_back(Prefetched{rows[n], o, DraftOut{}, Stamp{}, LookedFrom{}});
                look(n, 0, std::min(kFirst, chosen[n].size()));
                plan_ns += t1 - t0;
                lookup_ns += now_ns() - t1;
                planned += 1;
            });
            std::vector<size_t> more;  // rows with outcomes beyond their first, likeliest next outcome first
            for (size_t n = 0; n < rows.size(); ++n)
                if (chosen[n].size() > kFirst && looked[n] == kFirst) more.push_back(n);
            std::stable_sort(more.begin(), more.end(), [&](size_t x, size_t y) {
                return chosen[x][kFirst].probability > chosen[y][kFirst].probability;
            });
            workers_.run(more.size(), [&](size_t m) {
                const int64_t t2 = now_ns();
                look(more[m], kFirst, chosen[more[m]].size());
                lookup_ns += now_ns() - t2;
            });
            for (size_t n = 0; n < rows.size(); ++n) found[n].resize(looked[n]);  // (the rest were not looked up)
            if (planned.load() < static_cast<int64_t>(rows.size())) {
                span_.chosen = -1;  // the stop came before every row was planned
            } else {
                for (const auto& mine : chosen) span_.chosen += static_cast<int64_t>(mine.size());
            }
        } else {
            // A budget across the batch: every row's outcomes first, then the allocation, then lookups.
            std::vector<std::vector<OutcomeOut>>& candidates = plan_candidates_;
            candidates.resize(rows.size());  // allocate reads every row given
            std::vector<int64_t> keys(rows.size());
            std::atomic<bool> cancelled{false};
            const int64_t t0 = now_ns();
            constexpr size_t kPlanGroup = 8;  // rows planned in lock step, their cache misses overlapped
            workers_.run((rows.size() + kPlanGroup - 1) / kPlanGroup, [&](size_t g) {
                if (cancel_.load(std::memory_order_relaxed)) {
                    cancelled.store(true, std::memory_order_relaxed);
                    return;
                }
                const size_t first = g * kPlanGroup, n = std::min(kPlanGroup, rows.size() - first);
                Request* group[kPlanGroup];
                int64_t begins[kPlanGroup], ends[kPlanGroup];
                for (size_t i = 0; i < n; ++i) {
                    group[i] = reqs[rows[first + i]];
                    keys[first + i] = group[i]->handle;
                    begins[i] = offsets[rows[first + i]];
                    ends[i] = offsets[rows[first + i] + 1];
                }
                predict_rows(group, begins, ends, n, tokens, probs, global, floor, candidates.data() + first);
            });
            if (cancelled.load()) {  // a budget allocated over part of the batch is not the reference's
                span_.chosen = -1;
                return;
            }
            std::vector<std::vector<OutcomeOut>>& chosen = plan_chosen_;
            allocate(candidates, keys, alloc, chosen);
            last_cut_ = budget_cut(chosen, alloc.global_budget);
            const int64_t t1 = now_ns();
            plan_ns += t1 - t0;
            planned += static_cast<int64_t>(rows.size());
            struct Job {
                size_t n;
                OutcomeOut outcome;
            };
            std::vector<Job> jobs;
            for (size_t n = 0; n < rows.size(); ++n)
                for (const auto& o : chosen[n]) jobs.push_back(Job{n, o});
            span_.chosen = static_cast<int64_t>(jobs.size());
            // Likeliest first across the batch: what a cancel leaves undone is the least likely.
            std::stable_sort(jobs.begin(), jobs.end(),
                             [](const Job& x, const Job& y) { return x.outcome.probability > y.outcome.probability; });
            // In groups of consecutive jobs drafted together (a cancel waits for one group at most).
            constexpr size_t kGroup = 4;
            std::vector<DraftOut> drafts(jobs.size());
            std::vector<LookedFrom> froms(jobs.size());
            std::vector<uint8_t> done(jobs.size(), 0);
            workers_.run((jobs.size() + kGroup - 1) / kGroup, [&](size_t g) {
                if (cancel_.load(std::memory_order_relaxed)) return;
                const size_t first = g * kGroup, size = std::min(kGroup, jobs.size() - first);
                OutcomeLookup items[kGroup]{};
                DraftOut* outs[kGroup]{};
                LookedFrom* from[kGroup]{};
                for (size_t i = 0; i < size; ++i) {
                    const Job& job = jobs[first + i];
                    items[i] = OutcomeLookup{reqs[rows[job.n]], offsets[rows[job.n]], job.outcome};
                    outs[i] = &drafts[first + i];
                    from[i] = &froms[first + i];
                }
                lookup_outcomes(items, size, tokens, k, global, outs, from);
                for (size_t i = 0; i < size; ++i) done[first + i] = 1;
            });
            for (size_t jn = 0; jn < jobs.size(); ++jn)
                if (done[jn]) found[jobs[jn].n].push_back(Prefetched{rows[jobs[jn].n], jobs[jn].outcome,
                                                                     std::move(drafts[jn]), Stamp{}, froms[jn]});
            lookup_ns += now_ns() - t1;
        }
        size_t total = 0;
        for (const auto& f : found) total += f.size();
        span_.done = static_cast<int64_t>(total);
        outcomes_.reserve(total);
        cache_.reset(total);
        for (auto& f : found) {
            for (auto& p : f) {
                const Request& r = *reqs[p.row];
                p.stamp = stamp(r);
                cache_.insert(CacheKey{r.handle, p.outcome.accepted, p.outcome.token}, static_cast<int32_t>(outcomes_.size()));
                outcomes_.push_back(std::move(p));
            }
        }
        cache_valid_ = true;
        timings_["plan_ns"] += plan_ns.load();
        timings_["plan_rows"] += planned.load();
        timings_["prefetch_lookup_ns"] += lookup_ns.load();
        timings_["prefetch_lookups"] += static_cast<int64_t>(total);
    }
};

}  // namespace ngramrl

using namespace ngramrl;

PYBIND11_MODULE(_native, m) {
    m.doc() = "ngramrl's native drafting core (see ngramrl/core/batch.py)";
    // What ngramrl.core.extension checks for: committed_rows takes each request's end (the newest
    // interface change).
    m.attr("request_ends_interface") = true;
    // xtx and xty are updated in place: an array that would need converting is refused, not copied
    m.def("step_cost_fold", &step_cost_fold, py::arg("xtx").noconvert(), py::arg("xty").noconvert(), py::arg("yty"),
          py::arg("observed"), py::arg("knees"), py::arg("decay"));
    m.def("step_cost_solve", &step_cost_solve, py::arg("xtx"), py::arg("xty"), py::arg("yty"), py::arg("ridge"));
    m.def("batch_ranks", &batch_ranks, py::arg("ids"), py::arg("known"), py::arg("missing"), py::arg("last_ids"),
          py::arg("last_ranks"));
    m.def("committed_rows", &committed_rows, py::arg("sampled"), py::arg("arrival"), py::arg("num_tokens"),
          py::arg("max_model_len"), py::arg("k"), py::arg("sent_ranks"), py::arg("sent_offsets"),
          py::arg("sent_num_tokens"), py::arg("ends"));
    m.def("truncate_rows", &truncate_rows, py::arg("tokens"), py::arg("offsets"), py::arg("probs"), py::arg("keep"),
          py::arg("vocab"));
    m.def("draft_lists", &draft_lists, py::arg("size"), py::arg("positions"), py::arg("rows"), py::arg("tokens"),
          py::arg("offsets"));
    m.def("target_rows", &target_rows, py::arg("tokens"), py::arg("offsets"), py::arg("probs"), py::arg("keep"),
          py::arg("vocab"), py::arg("size"), py::arg("positions"), py::arg("recycled").none(true) = nullptr);
    py::class_<DraftLists>(m, "DraftLists")
        .def(py::init<>())
        .def_property_readonly("held", &DraftLists::held)
        .def_property_readonly("refilled", &DraftLists::refilled)
        .def("release", &DraftLists::release);
    py::class_<Core>(m, "Core")
        .def(py::init([](int64_t rollouts_per_prompt, int64_t epochs_kept, int64_t max_tokens, int64_t prompt_tail,
                         int32_t max_draft, double min_confidence, int32_t min_match, int32_t rematch_tokens,
                         bool use_global, int32_t draft_levels, int32_t path_width, std::vector<int32_t> stop_tokens,
                         int32_t budget, int64_t global_budget, int64_t shared_budget, double plan_floor,
                         double min_probability, int32_t levels, double prior_strength, double calibration_decay,
                         int threads, bool follow, std::vector<int> cores) {
                 HistoryConfig h{rollouts_per_prompt, epochs_kept, max_tokens, prompt_tail};
                 DrafterConfig d;
                 d.max_draft = max_draft;
                 d.chain.min_confidence = min_confidence;
                 d.chain.min_match = min_match;
                 d.chain.levels = draft_levels;
                 d.chain.path_width = path_width;
                 d.chain.stop_tokens = std::move(stop_tokens);
                 d.rematch_tokens = rematch_tokens;
                 d.use_global = use_global;
                 PrefetchConfig p;
                 p.allocate = AllocateConfig{budget, global_budget, min_probability};
                 p.shared_budget = shared_budget;
                 p.plan_floor = plan_floor;
                 p.levels = levels;
                 return std::make_unique<Core>(h, d, p, prior_strength, calibration_decay, threads, follow,
                                               cores);
             }),
             py::arg("rollouts_per_prompt"), py::arg("epochs_kept"), py::arg("max_tokens"), py::arg("prompt_tail"),
             py::arg("max_draft"), py::arg("min_confidence"), py::arg("min_match"), py::arg("rematch_tokens"),
             py::arg("use_global"), py::arg("draft_levels"), py::arg("path_width"), py::arg("stop_tokens"), py::arg("budget"), py::arg("global_budget"),
             py::arg("shared_budget"), py::arg("plan_floor"), py::arg("min_probability"), py::arg("levels"), py::arg("prior_strength"), py::arg("calibration_decay"),
             py::arg("threads"), py::arg("follow"), py::arg("cores") = std::vector<int>{})
        .def("add_rollout",
             [](Core& c, const std::string& id, py::handle prompt, py::handle output, int64_t epoch) {
                 Tokens p = token_ids(prompt, "prompt"), o = token_ids(output, "output");
                 checked_epoch(epoch, "epoch");
                 py::gil_scoped_release release;
                 c.add_rollout(id, p, o, epoch);
             })
        .def("build_indexes", &Core::build_indexes, py::call_guard<py::gil_scoped_release>())
        .def("index_prompt", &Core::index_prompt, py::call_guard<py::gil_scoped_release>())
        .def("export", &Core::export_history)
        .def("clear", &Core::clear, py::call_guard<py::gil_scoped_release>())
        .def("export_prompts", &Core::export_prompts)
        .def("restore_prompt", &Core::restore_prompt, py::arg("id"), py::arg("prompt"), py::arg("rollouts"),
             py::arg("replace") = false, py::call_guard<py::gil_scoped_release>())
        .def("stored_tokens", &Core::stored_tokens, py::call_guard<py::gil_scoped_release>())
        .def("num_prompts", &Core::num_prompts, py::call_guard<py::gil_scoped_release>())
        .def("prompt_ids", &Core::prompt_ids)
        .def("rollout_count", &Core::rollout_count)
        .def("counters", &Core::counters)
        .def("index_shape", &Core::index_shape)
        .def("timings", &Core::timings)
        .def("followed", &Core::followed)
        .def("memory_bytes", &Core::memory_bytes, py::call_guard<py::gil_scoped_release>())
        .def("start",
             [](Core& c, const std::vector<std::string>& ids, py::sequence prompts, py::sequence outputs,
                bool register_prompt) {
                 if (py::len(prompts) != ids.size() || py::len(outputs) != ids.size())
                     throw py::value_error("start got " + std::to_string(ids.size()) + " prompt ids, " +
                                           std::to_string(py::len(prompts)) + " prompts and " +
                                           std::to_string(py::len(outputs)) + " outputs");
                 std::vector<Tokens> p(ids.size()), o(ids.size());
                 for (size_t i = 0; i < ids.size(); ++i) {
                     const py::object prompt = prompts[i], output = outputs[i];
                     p[i] = token_ids(prompt, "prompts", i);
                     o[i] = token_ids(output, "outputs", i);
                 }
                 py::gil_scoped_release release;
                 return c.start(ids, p, o, register_prompt);
             })
        .def("finish", &Core::finish, py::call_guard<py::gil_scoped_release>())
        .def("drop_ended", &Core::drop_ended, py::call_guard<py::gil_scoped_release>())
        .def("known", &Core::known)
        .def("step",
             [](Core& c, I64 handles, I32 tokens, I64 offsets, I32 ks) {
                 auto h = from_array(handles);
                 auto t = from_array(tokens);
                 auto o = from_array(offsets);
                 auto k = from_array(ks);
                 {
                     py::gil_scoped_release release;
                     c.step(h, t, o, k);
                 }
                 return c.step_result();
             })
        .def("absorb",
             [](Core& c, I64 handles, bool now) {
                 auto h = from_array(handles);
                 py::gil_scoped_release release;
                 c.absorb(h, now);
             })
        .def("prefetch",
             [](Core& c, I64 handles, I32 tokens, I64 offsets, F64 probs, int32_t k, I64 absorb_first) {
                 auto h = from_array(handles);
                 auto t = from_array(tokens);
                 auto o = from_array(offsets);
                 auto p = from_array(probs);
                 auto a = from_array(absorb_first);
                 py::gil_scoped_release release;
                 c.prefetch(h, t, o, p, k, a);
             })
        .def("collect", &Core::collect)
        .def("stop", &Core::stop, py::call_guard<py::gil_scoped_release>())
        .def("set_budget", &Core::set_budget, py::call_guard<py::gil_scoped_release>())
        .def("take_span", &Core::take_span)
        .def("wait_idle", &Core::wait_idle, py::call_guard<py::gil_scoped_release>())
        .def("observe",
             [](Core& c, F64 probs, I64 offsets, I64 accepted) {
                 auto p = from_array(probs);
                 auto o = from_array(offsets);
                 auto a = from_array(accepted);
                 py::gil_scoped_release release;
                 c.observe(p, o, a);
             })
        .def("chances",
             [](Core& c, F64 probs, I64 offsets) {
                 auto p = from_array(probs);
                 auto o = from_array(offsets);
                 std::vector<double> out;
                 {
                     py::gil_scoped_release release;
                     out = c.chances(p, o);
                 }
                 return to_array(out);
             })
        .def("lengths",
             [](Core& c, F64 probs, I64 offsets, double scale, std::vector<double> coefficients, double min_gain,
                bool adaptive, int32_t probe_tokens) {
                 auto p = from_array(probs);
                 auto o = from_array(offsets);
                 if (o.empty()) throw py::value_error("offsets needs rows + 1 entries");
                 LengthChoice out;
                 {
                     py::gil_scoped_release release;
                     out = c.lengths(p, o, scale, coefficients, min_gain, adaptive, probe_tokens);
                 }
                 return py::make_tuple(to_array(out.lengths), out.expected, out.paid, out.probed);
             })
        .def("calibration_state", &Core::calibration_state)
        .def("load_calibration_state", &Core::load_calibration_state)
        .def("continuations",
             [](Core& c, const std::string& id, py::handle prompt, py::handle output, int32_t m) {
                 return c.continuations(id, token_ids(prompt, "prompt"), token_ids(output, "output"), m);
             })
        .def("lookup_context",
             [](Core& c, const std::string& id, py::handle prompt, py::handle output, int32_t k) {
                 return c.lookup_context(id, token_ids(prompt, "prompt"), token_ids(output, "output"), k);
             });
}
