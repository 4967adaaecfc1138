// Resuming a run: the newest intact checkpoint of its folder, checked against
// the run that resumes it (its data, the order of an epoch's samples, the size
// of a window; another number of ranks keeps the effective batch), and a run
// that had already ended handed back as it was.

#include <cstdio>
#include <string>

#include "observe/format.hpp"
#include "train/run_internal.hpp"
#include "wick/options.hpp"

namespace fs = std::filesystem;

namespace wick {
namespace {

std::string order_text(bool shuffled, std::int64_t seed) {
  return shuffled ? strf("shuffled with seed %lld", static_cast<long long>(seed)) : "in order (shuffle = false)";
}

// The checkpoint's loop position and the data it points into.
void check_position(const Resolved& r, const fs::path& from, const nlohmann::json& e, std::int64_t samples) {
  const std::string& L = r.label;
  // the loop's position: wick.train always writes it, and a checkpoint
  // without it would restart the epoch without a word
  for (const char* k : {"epoch", "window"})
    if (!e.contains(k))
      throw Error(strf("%s: checkpoint %s has no extra.%s in its state.json (wick.train writes the run's position "
                       "there): it was edited, or written by a custom loop; resume it there, or start over",
                       L.c_str(), from.c_str(), k));
  // the same data: a window's position means other samples in another data set
  if (e.contains("samples") && e["samples"].is_number_integer() && e["samples"].get<std::int64_t>() != samples)
    throw Error(strf("%s: checkpoint %s was written training on %lld samples, this run's data holds %lld: its "
                     "position would point at other samples; resume with the same data, or start over "
                     "(overwrite = true)",
                     L.c_str(), from.c_str(), static_cast<long long>(e["samples"].get<std::int64_t>()),
                     static_cast<long long>(samples)));
  // mid-epoch, the order of the epoch's samples: another seed or shuffle
  // would repeat some of them and skip others
  if (e.value("window", std::int64_t{0}) > 0 && e.contains("shuffle") && e["shuffle"].is_boolean() &&
      e.contains("seed") && e["seed"].is_number_integer()) {
    const bool was_shuffled = e["shuffle"].get<bool>(), shuffled = r.o.get_bool("shuffle");
    const auto was_seed = e["seed"].get<std::int64_t>(), seed = r.o.get_int("seed");
    if (was_shuffled != shuffled || (shuffled && was_seed != seed))
      throw Error(strf("%s: checkpoint %s stopped in the middle of an epoch whose samples were %s; this run's "
                       "are %s: its position would repeat some samples and skip others; resume with %s, or "
                       "start over (overwrite = true)",
                       L.c_str(), from.c_str(), order_text(was_shuffled, was_seed).c_str(),
                       order_text(shuffled, seed).c_str(),
                       was_shuffled ? strf("shuffle = true, seed = %lld", static_cast<long long>(was_seed)).c_str()
                                    : "shuffle = false"));
  }
}

// The window: on the same ranks, a window of another size would repeat or
// skip samples; on another number of ranks, accumulate keeps the effective batch.
void check_window(Resolved& r, const fs::path& from, const nlohmann::json& e) {
  const std::string& L = r.label;
  const int world = r.dist.world_size;
  const int ckpt_world = e.value("world_size", world);
  if (r.micro_auto) return;
  if (ckpt_world == world && e.contains("micro_batch") && e.contains("accumulate")) {
    const std::int64_t was = e["micro_batch"].get<std::int64_t>() * e["accumulate"].get<std::int64_t>();
    if (was != r.micro_batch * r.accumulate)
      throw Error(strf("%s: checkpoint %s was written with windows of micro_batch %lld x accumulate %lld = %lld "
                       "samples per rank, this run's hold %lld x %lld = %lld: its position would repeat or skip "
                       "samples; resume with windows of %lld (micro_batch x accumulate), or start over "
                       "(overwrite = true)",
                       L.c_str(), from.c_str(), static_cast<long long>(e["micro_batch"].get<std::int64_t>()),
                       static_cast<long long>(e["accumulate"].get<std::int64_t>()), static_cast<long long>(was),
                       static_cast<long long>(r.micro_batch), static_cast<long long>(r.accumulate),
                       static_cast<long long>(r.micro_batch * r.accumulate), static_cast<long long>(was)));
  }
  if (ckpt_world == world) return;
  const std::int64_t was_micro = e.value("micro_batch", std::int64_t{1}), was_acc = e.value("accumulate", std::int64_t{1});
  const std::int64_t effective = was_micro * was_acc * ckpt_world;
  const std::int64_t per = r.micro_batch * world;
  if (effective % per != 0)
    throw Error(strf("%s: cannot resume a run of effective batch %lld (micro %lld x accumulate %lld x %d ranks) "
                     "with micro_batch %lld on %d ranks: %lld is not a multiple of %lld",
                     L.c_str(), static_cast<long long>(effective), static_cast<long long>(was_micro),
                     static_cast<long long>(was_acc), ckpt_world, static_cast<long long>(r.micro_batch), world,
                     static_cast<long long>(effective), static_cast<long long>(per)));
  if (r.rank0)
    err_line(strf("%s: the checkpoint was made by %d ranks, this run has %d: accumulate %lld -> %lld keeps the "
                  "effective batch of %lld",
                  L.c_str(), ckpt_world, world, static_cast<long long>(r.accumulate),
                  static_cast<long long>(effective / per), static_cast<long long>(effective)));
  r.accumulate = effective / per;
}

}  // namespace

ResumePoint find_resume_point(Resolved& r, const PriorRun& prior, const fs::path& ckpt_dir, std::int64_t samples) {
  const std::string& L = r.label;
  ResumePoint p;
  if (!r.o.get_bool("resume")) return p;
  if (!prior.problem.empty())
    throw Error(L + ": resume = true, but " + prior.problem + " (mend it, or remove it to resume from the "
                "checkpoints alone)");
  std::vector<std::string> damaged;
  p.checkpoint = find_checkpoint(ckpt_dir, &damaged);
  if (p.checkpoint.empty() && !damaged.empty()) {
    std::string all;
    for (const auto& d : damaged) all += (all.empty() ? "" : "; ") + d;
    throw Error(L + ": resume = true, but no checkpoint in " + ckpt_dir.string() + " is intact: " + all);
  }
  if (r.rank0)
    for (const auto& d : damaged) err_line("wick: skipping a damaged checkpoint: " + d);
  if (p.checkpoint.empty()) return p;
  p.state = read_checkpoint_state(p.checkpoint);
  const auto e = p.state.value("extra", nlohmann::json::object());
  check_position(r, p.checkpoint, e, samples);
  check_window(r, p.checkpoint, e);
  return p;
}

std::optional<nlohmann::json> already_ended(const Resolved& r, const PriorRun& prior, const Trainer& trainer,
                                            const ResumePoint& from, const fs::path& out, std::int64_t total) {
  const std::string status = prior.meta.is_object() ? prior.meta.value("status", "") : "";
  const bool stopped = status == "stopped";  // on purpose (patience, or a callback): it ended there
  // a finished run stays as it was; the model holds its final weights
  const bool finished = status == "finished" && trainer.steps() >= total;
  if (!stopped && !finished) return std::nullopt;
  if (!r.quiet) {
    if (stopped)
      err_line(strf("wick: the run in %s stopped at step %lld (%s): nothing to resume (overwrite = true starts it "
                    "again); its files are unchanged",
                    out.c_str(), static_cast<long long>(trainer.steps()),
                    prior.meta.contains("stopped") && prior.meta["stopped"].is_object()
                        ? prior.meta["stopped"].value("by", std::string("?")).c_str()
                        : "?"));
    else
      err_line(strf("wick: the run in %s finished at step %lld of %lld: nothing to resume (raise epochs or "
                    "max_steps to train further); its files are unchanged",
                    out.c_str(), static_cast<long long>(trainer.steps()), static_cast<long long>(total)));
  }
  nlohmann::json done = {{"status", status},
                         {"steps", trainer.steps()},
                         {"history", nlohmann::json::array()},
                         {"skipped_steps", trainer.skipped_steps()},
                         {"checkpoint", from.checkpoint.string()},
                         {"out", out.string()},
                         {"already_finished", true}};
  for (const char* k : {"final_loss", "best_loss", "eval", "micro_batch", "accumulate", "memory", "peak_memory",
                        "seconds", "loss_scale", "split", "skipped_files", "skipped_items"})
    if (prior.meta.contains(k)) done[k] = prior.meta[k];
  if (stopped)
    for (const char* k : {"best", "stopped"})
      if (prior.meta.contains(k)) done[k] = prior.meta[k];
  return done;
}

}  // namespace wick
