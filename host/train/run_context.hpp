#pragma once
// The run context: the command line's key=value pairs for one recipe, and
// which keys were read, by whom and when. The CLI builds it, the Lua runtime
// owns it (wick.args reads through it) and each wick.train call takes the
// keys naming its options from it. It decides which keys to warn about:
// before a run those no option names (a likely typo), at the recipe's end
// those never read; each key at most once.

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace wick {

class RunContext {
 public:
  using Pair = std::pair<std::string, std::string>;
  /// Who read a key: the recipe (wick.args) or a run (an option override).
  enum class Reader { Recipe, Run };
  /// A key's first read: by whom, and how many runs had started before it.
  struct Read {
    Reader by;
    int runs_before;
  };

  /// `args`: the pairs after the recipe, in command-line order, as given.
  explicit RunContext(std::vector<Pair> args = {});

  const std::vector<Pair>& args() const { return args_; }
  /// The text given for `key` (the last one, when given twice), if any.
  std::optional<std::string> value(const std::string& key) const;

  /// Notes a read of `key`; only its first read is kept, and a key not
  /// given is ignored (a recipe may read any key).
  void read(const std::string& key, Reader by);
  /// The first read of `key`, if it was read.
  std::optional<Read> first_read(const std::string& key) const;

  /// A run (wick.train) starts: later reads count as after it.
  void start_run() { ++runs_started_; }
  int runs_started() const { return runs_started_; }

  /// The pairs whose key is unread, not reported yet and, with `only`, for
  /// which only(key) holds, in command-line order; their keys count as
  /// reported from now on, so no key is named in two warnings.
  std::vector<Pair> report_unread(const std::function<bool(const std::string&)>& only = {});

 private:
  std::vector<Pair> args_;
  std::map<std::string, Read> reads_;
  std::set<std::string> reported_;
  int runs_started_ = 0;
};

/// "k=v k2=v2": pairs as a warning names them.
std::string join_pairs(const std::vector<RunContext::Pair>& pairs);

}  // namespace wick
