// The step-cost fit of ngramrl/core/cost.py (StepCostModel._fold and _solve) for every candidate
// knee at once. The proposer solves it every few engine steps; after a forward has flushed the
// caches the NumPy version's dozen calls took about 180 us a solve, most of the proposer's time at
// one request in flight. Same sums and the same systems; the solve is Gaussian elimination with
// partial pivoting, so the coefficients agree with LAPACK's to rounding.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "rows.hpp"

namespace py = pybind11;

namespace ngramrl {

constexpr int kCostFeatures = 4;  // 1, requests, draft tokens past the plateau, any draft token

using F64Out = py::array_t<double, py::array::c_style>;  // updated in place: no converted copy

inline void check_fit_arrays(const py::array& xtx, const py::array& xty, const char* where) {
    if (xtx.ndim() != 3 || xtx.shape(1) != kCostFeatures || xtx.shape(2) != kCostFeatures || xty.ndim() != 2 ||
        xty.shape(0) != xtx.shape(0) || xty.shape(1) != kCostFeatures)
        throw py::value_error(std::string(where) + ": xtx must be (knees, 4, 4) and xty (knees, 4)");
}

// The observations (requests, draft tokens, seconds), oldest first, folded into the sums of every
// knee, each weighted by decay^(its age): xtx and xty are updated in place; returns the new yty.
inline double step_cost_fold(F64Out xtx, F64Out xty, double yty, const F64& observed, const F64& knees, double decay) {
    check_fit_arrays(xtx, xty, "step_cost_fold");
    const int64_t num_knees = xtx.shape(0);
    if (observed.ndim() != 2 || observed.shape(1) != 3)
        throw py::value_error("step_cost_fold: observations must be (steps, 3)");
    if (knees.size() != num_knees) throw py::value_error("step_cost_fold: one knee per row of xtx");
    const int64_t m = observed.shape(0);
    const double* obs = observed.data();
    const double* knee = knees.data();
    double* a = xtx.mutable_data();
    double* b = xty.mutable_data();
    std::vector<double> weights(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) weights[i] = std::pow(decay, static_cast<double>(m - 1 - i));
    const double aged = std::pow(decay, static_cast<double>(m));
    for (int64_t k = 0; k < num_knees; ++k) {
        double sa[kCostFeatures][kCostFeatures] = {};
        double sb[kCostFeatures] = {};
        for (int64_t i = 0; i < m; ++i) {
            const double requests = obs[3 * i], drafts = obs[3 * i + 1], seconds = obs[3 * i + 2];
            const double x[kCostFeatures] = {
                1.0, requests,
                std::max(0.0, requests + drafts - knee[k]) - std::max(0.0, requests - knee[k]),
                drafts > 0 ? 1.0 : 0.0};
            for (int f = 0; f < kCostFeatures; ++f) {
                const double wx = weights[i] * x[f];
                for (int g = 0; g < kCostFeatures; ++g) sa[f][g] += wx * x[g];
                sb[f] += wx * seconds;
            }
        }
        double* ak = a + k * kCostFeatures * kCostFeatures;
        double* bk = b + k * kCostFeatures;
        for (int f = 0; f < kCostFeatures; ++f) {
            for (int g = 0; g < kCostFeatures; ++g) ak[f * kCostFeatures + g] = aged * ak[f * kCostFeatures + g] + sa[f][g];
            bk[f] = aged * bk[f] + sb[f];
        }
    }
    double squares = 0.0;
    for (int64_t i = 0; i < m; ++i) squares += weights[i] * obs[3 * i + 2] * obs[3 * i + 2];
    return aged * yty + squares;
}

// Least squares for every knee: (solutions (knees, 4), squared errors (knees,)), each system
// regularized by ridge * max(1, its trace).
inline py::tuple step_cost_solve(const F64& xtx, const F64& xty, double yty, double ridge) {
    check_fit_arrays(xtx, xty, "step_cost_solve");
    const int64_t num_knees = xtx.shape(0);
    F64Out solutions({num_knees, static_cast<int64_t>(kCostFeatures)});
    F64Out errors(num_knees);
    const double* a = xtx.data();
    const double* b = xty.data();
    double* s = solutions.mutable_data();
    double* e = errors.mutable_data();
    constexpr int n = kCostFeatures;
    for (int64_t k = 0; k < num_knees; ++k) {
        const double* ak = a + k * n * n;
        const double* bk = b + k * n;
        double trace = 0.0;
        for (int f = 0; f < n; ++f) trace += ak[f * n + f];
        const double shift = ridge * std::max(1.0, trace);
        double m[n][n + 1];
        for (int f = 0; f < n; ++f) {
            for (int g = 0; g < n; ++g) m[f][g] = ak[f * n + g] + (f == g ? shift : 0.0);
            m[f][n] = bk[f];
        }
        for (int col = 0; col < n; ++col) {
            int pivot = col;
            for (int r = col + 1; r < n; ++r)
                if (std::fabs(m[r][col]) > std::fabs(m[pivot][col])) pivot = r;
            if (pivot != col)
                for (int c = col; c <= n; ++c) std::swap(m[col][c], m[pivot][c]);
            for (int r = col + 1; r < n; ++r) {
                const double factor = m[r][col] / m[col][col];
                for (int c = col; c <= n; ++c) m[r][c] -= factor * m[col][c];
            }
        }
        double x[n];
        for (int r = n - 1; r >= 0; --r) {
            double v = m[r][n];
            for (int c = r + 1; c < n; ++c) v -= m[r][c] * x[c];
            x[r] = v / m[r][r];
        }
        double cross = 0.0, quadratic = 0.0;
        for (int f = 0; f < n; ++f) {
            cross += x[f] * bk[f];
            for (int g = 0; g < n; ++g) quadratic += x[f] * ak[f * n + g] * x[g];
        }
        for (int f = 0; f < n; ++f) s[k * n + f] = x[f];
        e[k] = yty - 2.0 * cross + quadratic;
    }
    return py::make_tuple(solutions, errors);
}

}  // namespace ngramrl
