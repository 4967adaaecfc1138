"""image_folder and video_folder: a class folder with no files is refused
naming it (skipped, it shifted every later class's label, as torchvision's
ImageFolder refuses it), and a file that is no image says so, naming it."""
from harness import Case


def folders(ext, classes, recipe):
    """root/<class>/ for each class, with one file x<ext> holding `classes[c]`
    (None: the folder stays empty), and r.lua."""
    def setup(d):
        for c, content in classes.items():
            (d / "root" / c).mkdir(parents=True)
            if content is not None:
                (d / "root" / c / ("x" + ext)).write_text(content)
        (d / "r.lua").write_text("local wick = require 'wick'\n" + recipe)
    return setup


IMAGES = "local d = wick.data('image_folder', { root = 'root', on_error = 'fail' })\n"

CASES = [
    Case("image_folder class folder without images", ["run", "r.lua"],
         r"r\.lua:2: .*image_folder: the class folder root/b holds no images \(extensions searched: "
         r"\.jpg,\.jpeg,\.png,\.webp,\.bmp\), expected files in every folder under root \(each folder is a class\)",
         setup=folders(".png", {"a": "x", "b": None, "c": "x"}, IMAGES)),
    Case("image_folder two class folders without images", ["run", "r.lua"],
         r"r\.lua:2: .*image_folder: the class folders root/a,root/c hold no images",
         setup=folders(".png", {"a": None, "b": "x", "c": None}, IMAGES)),
    Case("video_folder class folder without clips", ["run", "r.lua"],
         r"r\.lua:2: .*video_folder: the class folder root/b holds no clips \(extensions searched: \.mp4,",
         setup=folders(".mp4", {"a": "x", "b": None},
                       "wick.data('video_folder', { root = 'root' })\n")),
    Case("a text file named .png", ["run", "r.lua"],
         r"r\.lua:3: .*image_folder: root/a/x\.png: not a decodable image \(FFmpeg",
         setup=folders(".png", {"a": "these are not pixels\n"}, IMAGES + "wick.save_samples(d, { 0 }, 's.safetensors')\n")),
]
