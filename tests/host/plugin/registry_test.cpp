#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <set>

#include "../../test_util.hpp"
#include "wick/model.hpp"

using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace wick {
namespace {

Registry test_registry() { return Registry({test::test_plugin_dir()}); }

TEST(Registry, FindsBuiltinPluginsWithTheirKinds) {
  auto& r = registry();
  std::map<std::string, PluginKind> want = {{"mlp", PluginKind::Model}, {"synthetic", PluginKind::Data},
                                            {"tensors", PluginKind::Data}, {"sgd", PluginKind::Optim},
                                            {"adamw", PluginKind::Optim},  {"schedule", PluginKind::Optim}};
  for (const auto& [name, kind] : want) {
    const auto& e = r.find(name);
    ASSERT_NE(e.descriptor, nullptr) << name;
    EXPECT_EQ(e.descriptor->kind, kind) << name;
    EXPECT_STREQ(e.descriptor->torch_version, TORCH_VERSION);
  }
}

TEST(Registry, RefusesAnotherAbiNamingFileAndBothVersions) {
  auto r = test_registry();
  const auto msg = test::error_of([&] { r.find("bad_abi"); });
  EXPECT_THAT(msg, HasSubstr("test_bad_abi.so"));
  EXPECT_THAT(msg, HasSubstr("ABI 999"));
  EXPECT_THAT(msg, HasSubstr("this host has ABI " + std::to_string(kAbiVersion)));
}

TEST(Registry, RefusesAnotherLibTorchNamingBothVersions) {
  auto r = test_registry();
  const auto msg = test::error_of([&] { r.find("old_torch"); });
  EXPECT_THAT(msg, HasSubstr("test_old_torch.so"));
  EXPECT_THAT(msg, HasSubstr("LibTorch 1.13.1"));
  EXPECT_THAT(msg, HasSubstr(std::string("LibTorch ") + TORCH_VERSION));
}

TEST(Registry, ReportsAThrowingFactoryWithItsMessage) {
  auto r = test_registry();
  const auto msg = test::error_of([&] { r.create("throws", PluginKind::Model, {{"size", Value(7)}}); });
  EXPECT_THAT(msg, HasSubstr("model 'throws'"));
  EXPECT_THAT(msg, HasSubstr("failed to build"));
  EXPECT_THAT(msg, HasSubstr("deliberate failure (size 7)"));
}

TEST(Registry, RefusesASelfContradictingSchema) {
  auto r = test_registry();
  const auto msg = test::error_of([&] { r.find("bad_schema"); });
  EXPECT_THAT(msg, HasSubstr("bad option schema"));
  EXPECT_THAT(msg, HasSubstr("option 'width'"));
  EXPECT_THAT(msg, HasSubstr("expected integer"));
}

TEST(Registry, RefusesAnObjectOfAnotherKindThanDeclared) {
  auto r = test_registry();
  EXPECT_EQ(r.find("wrong_object").descriptor->makes, ObjectKind::Transform);
  const auto msg = test::error_of([&] { r.create("wrong_object", PluginKind::Optim, {}); });
  EXPECT_THAT(msg, HasSubstr("test_wrong_object.so"));
  EXPECT_THAT(msg, HasSubstr("made a schedule where it declares a transform"));
}

TEST(Registry, RefusesADescriptorWhoseKindContradictsWhatItMakes) {
  auto r = test_registry();
  const auto msg = test::error_of([&] { r.find("kind_mismatch"); });
  EXPECT_THAT(msg, HasSubstr("is a data plugin that declares it makes a model"));
}

TEST(Registry, BuiltinsDeclareWhatTheyMake) {
  const std::map<std::string, ObjectKind> want = {{"adamw", ObjectKind::Optimizer}, {"schedule", ObjectKind::Schedule},
                                                  {"lora", ObjectKind::Transform},  {"qlora", ObjectKind::Transform},
                                                  {"video_folder", ObjectKind::Dataset}, {"mlp", ObjectKind::Model}};
  for (const auto& [name, makes] : want) EXPECT_EQ(registry().find(name).descriptor->makes, makes) << name;
}

TEST(Registry, ListsLibrariesThatAreNotPluginsAsUnusable) {
  auto r = test_registry();
  bool seen = false;
  for (const auto& e : r.entries())
    if (e.file.filename() == "test_not_a_plugin.so") {
      seen = true;
      EXPECT_THAT(e.error, HasSubstr("not a wick plugin"));
    }
  EXPECT_TRUE(seen);
}

// What `wick_plugin` points at is checked before anything is read through it:
// an int, a function, a null pointer or a pointer into code is refused, named.
TEST(Registry, RefusesAWickPluginSymbolThatIsNotADescriptor) {
  auto r = test_registry();
  const std::map<std::string, std::string> want = {
      {"test_int_alias.so", "as a 4-byte object, not a 8-byte pointer"},
      {"test_function_alias.so", "as a function"},
      {"test_null_alias.so", "points to nothing (a null pointer)"},
      {"test_code_alias.so", "points into code"}};
  std::set<std::string> seen;
  for (const auto& e : r.entries()) {
    auto it = want.find(e.file.filename().string());
    if (it == want.end()) continue;
    seen.insert(it->first);
    EXPECT_EQ(e.descriptor, nullptr) << it->first;
    EXPECT_THAT(e.error, HasSubstr(it->second)) << it->first;
    EXPECT_THAT(e.error, HasSubstr("WICK_PLUGIN(...) exports it as a pointer to the plugin's descriptor"));
    const auto msg = test::error_of([&] { r.find(e.name); });
    EXPECT_THAT(msg, HasSubstr(it->first));
    EXPECT_THAT(msg, HasSubstr(it->second));
  }
  EXPECT_EQ(seen.size(), want.size());
}

// A library whose static initialisation aborts is loaded in a child process
// first: this process survives, and the library is listed as unusable.
TEST(Registry, SurvivesALibraryThatAbortsWhileLoading) {
  auto r = test_registry();
  bool seen = false;
  for (const auto& e : r.entries())
    if (e.file.filename() == "test_aborts.so") {
      seen = true;
      EXPECT_EQ(e.library, nullptr) << "never loaded by this process";
      EXPECT_THAT(e.error, HasSubstr("was killed by SIGABRT"));
      EXPECT_THAT(e.error, HasSubstr("static initialisation"));
    }
  EXPECT_TRUE(seen);
  // the other test plugins are still there
  EXPECT_NE(r.find("throws").descriptor, nullptr);
  // and named by path, too
  const auto msg = test::error_of([&] { r.find((test::test_plugin_dir() / "test_aborts.so").string()); });
  EXPECT_THAT(msg, HasSubstr("was killed by SIGABRT"));
}

// dlopen's own reason, not boost's error code ("Bad file descriptor").
TEST(Registry, SaysWhyALibraryCannotBeLoaded) {
  test::TempDir d;
  { std::ofstream(d.path / "junk.so") << "not an ELF file"; }
  Registry r({d.path});
  ASSERT_EQ(r.entries().size(), 1u);
  const auto& e = r.entries()[0];
  EXPECT_THAT(e.error, HasSubstr("cannot be loaded: "));
  EXPECT_THAT(e.error, ::testing::Not(HasSubstr("Bad file descriptor")));
  EXPECT_THAT(e.error, ::testing::AnyOf(HasSubstr("invalid ELF header"), HasSubstr("file too short")));
  EXPECT_THAT(e.error, ::testing::Not(HasSubstr((d.path / "junk.so").string()))) << "the file is named once, by the caller";
}

TEST(Registry, UnknownNameListsTheKnownOnes) {
  const auto msg = test::error_of([&] { registry().find("mpl"); });
  EXPECT_THAT(msg, HasSubstr("unknown plugin 'mpl'"));
  EXPECT_THAT(msg, HasSubstr("mlp"));
  EXPECT_THAT(msg, HasSubstr("adamw"));
}

TEST(Registry, ANameGivenTwiceIsAnErrorNamingBothFiles) {
  test::TempDir a, b;
  const auto mlp = registry().find("mlp").file;
  fs::copy_file(mlp, a.path / "mlp.so");
  fs::copy_file(mlp, b.path / "mlp.so");
  Registry r({a.path, b.path});
  const auto msg = test::error_of([&] { r.find("mlp"); });
  EXPECT_THAT(msg, HasSubstr("given twice"));
  EXPECT_THAT(msg, HasSubstr((a.path / "mlp.so").string()));
  EXPECT_THAT(msg, HasSubstr((b.path / "mlp.so").string()));
  // the listing says so as well: both entries are unusable, naming both files
  ASSERT_EQ(r.entries().size(), 2u);
  for (const auto& e : r.entries()) {
    EXPECT_EQ(e.descriptor, nullptr);
    EXPECT_THAT(e.error, HasSubstr("is given twice"));
    EXPECT_THAT(e.error, HasSubstr((a.path / "mlp.so").string()));
  }
}

// Two plugin folders, searched in the order given: every plugin of the first
// comes before any of the second, and each name is found in its own folder.
TEST(Registry, SearchesTwoFoldersInTheOrderGiven) {
  test::TempDir a, b;
  fs::copy_file(registry().find("sgd").file, a.path / "sgd.so");
  fs::copy_file(registry().find("adamw").file, b.path / "adamw.so");
  fs::copy_file(registry().find("mlp").file, b.path / "mlp.so");
  for (const auto& [first, second] : {std::pair{a.path, b.path}, std::pair{b.path, a.path}}) {
    Registry r({first, second});
    std::vector<fs::path> folders;
    for (const auto& e : r.entries()) folders.push_back(e.file.parent_path());
    ASSERT_EQ(folders.size(), 3u);
    const auto in_first = std::count(folders.begin(), folders.end(), fs::canonical(first));
    EXPECT_TRUE(std::all_of(folders.begin(), folders.begin() + in_first,
                            [&](const fs::path& f) { return f == fs::canonical(first); }))
        << "the first folder's plugins come first";
  }
  Registry r({a.path, b.path});
  EXPECT_EQ(r.find("sgd").file.parent_path(), fs::canonical(a.path));
  EXPECT_EQ(r.find("adamw").file.parent_path(), fs::canonical(b.path));
}

// A name in both folders is an error (DESIGN.md: "a name given twice is an
// error naming both files"), naming the first folder's file first.
TEST(Registry, ANameInTwoFoldersIsAnErrorNamingThemInSearchOrder) {
  test::TempDir a, b;
  const auto mlp = registry().find("mlp").file;
  fs::copy_file(mlp, a.path / "mlp.so");
  fs::copy_file(mlp, b.path / "mlp.so");
  const auto fa = (fs::canonical(a.path) / "mlp.so").string(), fb = (fs::canonical(b.path) / "mlp.so").string();
  Registry ab({a.path, b.path});
  EXPECT_THAT(test::error_of([&] { ab.find("mlp"); }), HasSubstr(fa + " and " + fb));
  Registry ba({b.path, a.path});
  EXPECT_THAT(test::error_of([&] { ba.find("mlp"); }), HasSubstr(fb + " and " + fa));
}

// WICK_PLUGIN_PATH's folders come first, in their order, then wick's own.
TEST(Registry, PluginPathFoldersComeFirstInTheirOrder) {
  const char* old = std::getenv("WICK_PLUGIN_PATH");
  const std::string saved = old ? old : "";
  ::setenv("WICK_PLUGIN_PATH", "/first:/second", /*overwrite=*/1);
  const auto dirs = Registry::default_search_path();
  if (old) ::setenv("WICK_PLUGIN_PATH", saved.c_str(), 1);
  else ::unsetenv("WICK_PLUGIN_PATH");
  ASSERT_GE(dirs.size(), 3u);
  EXPECT_EQ(dirs[0], fs::path("/first"));
  EXPECT_EQ(dirs[1], fs::path("/second"));
  EXPECT_EQ(dirs.back().filename(), "plugins");
}

TEST(Registry, SearchesThePathInOrderAndSkipsRepeatedFolders) {
  test::TempDir a;
  fs::copy_file(registry().find("sgd").file, a.path / "sgd.so");
  // the same folder twice, once through a symlink, is one folder
  fs::create_directory_symlink(a.path, a.path.string() + "-link");
  Registry r({a.path, fs::path(a.path.string() + "-link")});
  EXPECT_EQ(r.find("sgd").file, a.path / "sgd.so");
  fs::remove(a.path.string() + "-link");
}

TEST(Registry, LoadsAPluginNamedByPath) {
  Registry r(std::vector<fs::path>{});
  const auto file = registry().find("mlp").file;
  auto obj = r.create(file.string(), PluginKind::Model, {});
  EXPECT_EQ(obj->object_kind(), ObjectKind::Model);
}

TEST(Registry, RefusesAPluginOfAnotherKind) {
  const auto msg = test::error_of([] { registry().create("adamw", PluginKind::Model, {}); });
  EXPECT_THAT(msg, HasSubstr("'adamw' is an optim plugin, not a model plugin"));
}

TEST(Registry, ObjectsKeepTheirLibraryLoaded) {
  // A private copy of mlp.so: its only handle is this test's registry.
  test::TempDir dir;
  fs::copy_file(registry().find("mlp").file, dir.path / "mlp.so");
  std::shared_ptr<Model> model;
  {
    Registry r({dir.path});
    model = std::static_pointer_cast<Model>(r.create("mlp", PluginKind::Model, {{"inputs", Value(3)}}));
  }  // the registry, and its handle on mlp.so, are gone
  Batch b{{"x", at::randn({5, 3})}, {"y", at::zeros({5}, at::kLong)}};
  auto r = model->forward(b);  // runs code from mlp.so
  EXPECT_EQ(r.items, 5);
  EXPECT_TRUE(std::isfinite(r.loss_sum.item<double>()));
}

}  // namespace
}  // namespace wick
