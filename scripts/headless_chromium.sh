#!/usr/bin/env bash
# A headless Chromium for the web view's browser tests (tests/controller/view/test_browser.py)
# and bench (bench/system/view_load.py), where no browser is installed and Playwright's own
# download is out of reach: the Linux build inside the npm package @sparticuz/chromium,
# unpacked once with node's brotli into a cache folder. Prints the path of a launcher that
# runs it headless with the flags it needs; give it to Playwright as `executable_path`.
#
#   scripts/headless_chromium.sh [CACHE_DIR]   (default: ${XDG_CACHE_HOME:-~/.cache}/flexmarl/headless-chromium)
#
# Needs node and npm (and the npm registry, the first time). Exit codes: 0 the launcher's
# path printed; 3 node or npm is missing (the tests skip, saying so); 1 anything else.
set -euo pipefail
version=153.0.0
launcher_version=3  # of the launcher written below: a change rewrites it
dir=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/flexmarl/headless-chromium}
dir=$(mkdir -p "$dir" && cd "$dir" && pwd)
launcher="$dir/chromium-headless"
if [ -x "$launcher" ] && [ -f "$dir/.version-$version-$launcher_version" ]; then echo "$launcher"; exit 0; fi
for tool in node npm; do
  command -v "$tool" >/dev/null || { echo "headless_chromium.sh: needs $tool (not found)" >&2; exit 3; }
done
work=$(mktemp -d "$dir/.unpack.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
npm pack --silent "@sparticuz/chromium@$version" >/dev/null
tar xzf "sparticuz-chromium-$version.tgz"
node -e '
const zlib = require("zlib"), fs = require("fs");
for (const f of ["chromium", "al2023.tar", "swiftshader.tar", "fonts.tar"])
  fs.writeFileSync(f, zlib.brotliDecompressSync(fs.readFileSync("package/bin/" + f + ".br")));'
chmod +x chromium
mkdir -p libs fonts
tar xf al2023.tar -C libs && tar xf swiftshader.tar -C libs && tar xf fonts.tar -C fonts
# The package's fonts.conf names the folders of the platform it was built for; this one
# names the fonts unpacked here, so text is drawn (and screenshots show it).
cat > fonts/fonts.conf <<CONF
<?xml version="1.0"?>
<!DOCTYPE fontconfig SYSTEM "fonts.dtd">
<fontconfig>
  <dir>$dir/fonts/fonts</dir>
  <dir>/usr/share/fonts</dir>
  <cachedir>$dir/fonts-cache</cachedir>
</fontconfig>
CONF
rm -rf "$dir/chromium" "$dir/libs" "$dir/fonts"
mv chromium libs fonts "$dir/"
cat > "$launcher" <<W
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$dir/libs/lib:$dir/libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export FONTCONFIG_FILE="$dir/fonts/fonts.conf"
# A POSIX locale (LANG unset, C or C.UTF-8) gives the page the language tag "en-US@posix",
# which Intl refuses (and charting libraries with it): the browser gets a named one.
export LANG=en_US.UTF-8 LC_ALL=en_US.UTF-8
exec "$dir/chromium" --headless=new --no-sandbox --disable-gpu --disable-dev-shm-usage --lang=en-US "\$@"
W
chmod +x "$launcher"
rm -f "$dir"/.version-*
touch "$dir/.version-$version-$launcher_version"
echo "$launcher"
