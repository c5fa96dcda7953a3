"""packaging/windows/polystrata.iss, checked as far as Linux allows (ISCC only runs on Windows): the section and
parameter syntax of Inno Setup 6, the preprocessor defines against what build.ps1 passes, the Pascal [Code] block's
structure and event signatures, and the settings the design asks for (per-user, disk spanning, models kept)."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ISS = ROOT / "packaging" / "windows" / "polystrata.iss"
BUILD_PS1 = ROOT / "packaging" / "windows" / "build.ps1"

# Inno Setup 6 help: the parameters of each entry section and their flags.
PARAMS = {
    "Languages": {"Name", "MessagesFile", "LicenseFile", "InfoBeforeFile", "InfoAfterFile"},
    "Tasks": {"Name", "Description", "GroupDescription", "Flags", "Components", "Check", "Languages"},
    "Files": {
        "Source",
        "DestDir",
        "DestName",
        "Flags",
        "Tasks",
        "Components",
        "Check",
        "Excludes",
        "Permissions",
        "Attribs",
        "FontInstall",
        "StrongAssemblyName",
        "BeforeInstall",
        "AfterInstall",
        "ExternalSize",
    },
    "Icons": {
        "Name",
        "Filename",
        "Parameters",
        "WorkingDir",
        "HotKey",
        "Comment",
        "IconFilename",
        "IconIndex",
        "AppUserModelID",
        "Flags",
        "Tasks",
        "Components",
        "Check",
    },
    "Run": {
        "Filename",
        "Description",
        "Parameters",
        "WorkingDir",
        "StatusMsg",
        "RunOnceId",
        "Verb",
        "Flags",
        "Tasks",
        "Components",
        "Check",
    },
    "UninstallDelete": {"Type", "Name", "Tasks", "Components", "Check"},
}
FLAGS = {
    "Tasks": {"checkablealone", "checkedonce", "dontinheritcheck", "exclusive", "restart", "unchecked"},
    "Files": {
        "ignoreversion",
        "recursesubdirs",
        "createallsubdirs",
        "skipifsourcedoesntexist",
        "onlyifdoesntexist",
        "uninsneveruninstall",
        "restartreplace",
        "replacesameversion",
        "confirmoverwrite",
        "isreadme",
    },
    "Icons": {
        "closeonexit",
        "createonlyiffileexists",
        "dontcloseonexit",
        "excludefromshowinnewinstall",
        "foldershortcut",
        "preventpinning",
        "runmaximized",
        "runminimized",
        "uninsneveruninstall",
        "useapppaths",
    },
    "Run": {
        "nowait",
        "postinstall",
        "skipifsilent",
        "shellexec",
        "runhidden",
        "runminimized",
        "runasoriginaluser",
        "unchecked",
        "waituntilidle",
        "waituntilterminated",
        "hidewizard",
        "skipifdoesntexist",
    },
}
UNINSTALL_DELETE_TYPES = {"files", "filesandordirs", "dirifempty"}
SETUP_DIRECTIVES = {
    "AppId",
    "AppName",
    "AppVersion",
    "AppVerName",
    "AppPublisher",
    "VersionInfoVersion",
    "DefaultDirName",
    "DefaultGroupName",
    "DisableProgramGroupPage",
    "PrivilegesRequired",
    "ArchitecturesAllowed",
    "ArchitecturesInstallIn64BitMode",
    "OutputDir",
    "OutputBaseFilename",
    "SetupIconFile",
    "UninstallDisplayIcon",
    "UninstallDisplayName",
    "WizardStyle",
    "Compression",
    "SolidCompression",
    "DiskSpanning",
    "DiskSliceSize",
    "CloseApplications",
    "RestartApplications",
}
# Directory constants, shell folders in non-administrative mode included.
CONSTANTS = {
    "app",
    "autopf",
    "autoprograms",
    "autodesktop",
    "userstartup",
    "localappdata",
    "userappdata",
    "tmp",
    "group",
    "userpf",
    "src",
    "sys",
}
PASCAL_EVENTS = {
    "CurStepChanged": "CurStep: TSetupStep",
    "CurUninstallStepChanged": "CurUninstallStep: TUninstallStep",
}


def _sections(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        m = re.fullmatch(r"\[(\w+)\]", line)
        if m and current != "Code":
            current = m.group(1)
            assert current not in out, f"section [{current}] appears twice"
            out[current] = []
        elif current is not None and line and not line.startswith(";") and not line.startswith("#"):
            out[current].append(raw if current == "Code" else line)
    return out


def _entry(line: str) -> dict[str, str]:
    """`Name: "value"; Flags: a b` into a dict; values in double quotes may hold ';' and doubled quotes."""
    params: dict[str, str] = {}
    for m in re.finditer(r'\s*(\w+):\s*("(?:[^"]|"")*"|[^;]*)\s*(?:;|$)', line):
        key, value = m.group(1), m.group(2).strip()
        if value.startswith('"'):
            value = value[1:-1].replace('""', '"')
        assert key not in params, f"{key} given twice in: {line}"
        params[key] = value
    rebuilt = "; ".join(f"{k}: ..." for k in params)
    assert params and line.count(":") >= len(params), f"cannot parse: {line} ({rebuilt})"
    return params


@pytest.fixture(scope="module")
def iss() -> str:
    return ISS.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def sections(iss: str) -> dict[str, list[str]]:
    return _sections(iss)


@pytest.fixture(scope="module")
def setup(sections: dict[str, list[str]]) -> dict[str, str]:
    out = {}
    for line in sections["Setup"]:
        key, _, value = line.partition("=")
        assert key.strip() in SETUP_DIRECTIVES, f"unknown [Setup] directive {key!r}"
        out[key.strip()] = value.strip()
    return out


def test_sections_and_entry_parameters(sections: dict[str, list[str]]) -> None:
    assert set(sections) == {
        "Setup",
        "Languages",
        "Tasks",
        "Files",
        "Icons",
        "Run",
        "UninstallDelete",
        "Code",
    }
    tasks = {_entry(line)["Name"] for line in sections["Tasks"]}
    for section, allowed in PARAMS.items():
        for line in sections[section]:
            entry = _entry(line)
            assert set(entry) <= allowed, f"[{section}] unknown parameter(s) {set(entry) - allowed}: {line}"
            for flag in entry.get("Flags", "").split():
                assert flag in FLAGS[section], f"[{section}] unknown flag {flag}: {line}"
            for task in entry.get("Tasks", "").split():
                assert task in tasks, f"[{section}] refers to task {task}, which [Tasks] does not define"
            if section == "UninstallDelete":
                assert entry["Type"] in UNINSTALL_DELETE_TYPES


def test_constants_and_defines_are_known(iss: str) -> None:
    # Defined here, or required from the command line (#ifndef X #error).
    defined = set(re.findall(r"^\s*#define\s+(\w+)", iss, re.M))
    defined |= set(re.findall(r"^\s*#ifndef\s+(\w+)\s*\n\s*#error", iss, re.M))
    for name in re.findall(r"\{#(\w+)\}", iss):
        assert name in defined, f"{{#{name}}} is used but never #defined"
    code_free = iss.split("[Code]")[0]
    for name in re.findall(r"(?<!\{)\{(\w+)\}", code_free):
        assert name in CONSTANTS, f"unknown constant {{{name}}}"
    for name in re.findall(r"\{cm:(\w+)", iss):
        assert name in {"CreateDesktopIcon", "AdditionalIcons", "LaunchProgram"}
    # Each #ifndef'd define is one build.ps1 passes with /D (or has a default here).
    passed = set(re.findall(r'"/D(\w+)=', BUILD_PS1.read_text(encoding="utf-8")))
    for name in re.findall(r"^\s*#ifndef\s+(\w+)", iss, re.M):
        assert name in passed, f"build.ps1 does not pass /D{name}"
    opens = len(re.findall(r"^\s*#if(n?def)?\b", iss, re.M))
    assert opens == len(re.findall(r"^\s*#endif\b", iss, re.M))


def test_per_user_install_with_disk_spanning(setup: dict[str, str]) -> None:
    assert setup["PrivilegesRequired"] == "lowest"  # no administrator rights
    assert setup["DefaultDirName"].startswith("{autopf}")  # {userpf} = %LOCALAPPDATA%\Programs under lowest
    assert setup["DiskSpanning"] == "yes"
    # Slices of at most 2.1e9 bytes are valid in every Inno Setup 6; the CUDA payload needs at least two.
    assert 262144 <= int(setup["DiskSliceSize"]) <= 2_100_000_000
    assert re.fullmatch(r"\{\{[0-9A-F]{8}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{12}\}", setup["AppId"])
    assert "{#AppVersion}" in setup["OutputBaseFilename"] and "{#Flavour}" in setup["OutputBaseFilename"]
    icon = (ISS.parent / setup["SetupIconFile"].replace("\\", "/")).resolve()
    assert icon == (ROOT / "resources" / "polystrata.ico").resolve() and icon.is_file()


def test_files_and_shortcuts_match_the_bundle(iss: str, sections: dict[str, list[str]]) -> None:
    spec = ast.parse((ROOT / "build.spec").read_text(encoding="utf-8"))
    names = next(
        ast.literal_eval(node.value)
        for node in spec.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "EXECUTABLES"
    )
    exes = {name + ".exe" for name, _, _ in names}
    for define in ("AppExe", "NodeExe"):
        value = re.search(rf'^#define {define} "([^"]+)"', iss, re.M)
        assert value and value.group(1) in exes, f"{define} is not one of the bundle's executables {exes}"
    # build.spec's COLLECT writes dist/PolyStrata; the script's default and build.ps1 both point there.
    assert re.search(r'COLLECT\([^)]*name="PolyStrata"', (ROOT / "build.spec").read_text(), re.S)
    assert '#define BundleDir "..\\..\\dist\\PolyStrata"' in iss
    assert "/DBundleDir=$Root\\dist\\PolyStrata" in BUILD_PS1.read_text(encoding="utf-8")
    files = [_entry(line) for line in sections["Files"]]
    assert files[0]["Source"] == "{#BundleDir}\\*"
    assert {"recursesubdirs", "createallsubdirs"} <= set(files[0]["Flags"].split())
    icons = {_entry(line)["Name"]: _entry(line) for line in sections["Icons"]}
    assert icons["{autoprograms}\\{#AppName}"]["Filename"] == "{app}\\{#AppExe}"  # Start menu
    startup = [e for name, e in icons.items() if name.startswith("{userstartup}")]
    assert {e["Tasks"] for e in startup} == {"autostart", "autostartnode"}
    node = next(e for e in startup if e["Tasks"] == "autostartnode")
    assert (node["Filename"], node["Parameters"]) == ("{app}\\{#NodeExe}", "serve")


def _code(sections: dict[str, list[str]]) -> str:
    code = "\n".join(sections["Code"])
    code = re.sub(r"\{[^}]*\}", " ", code)  # { comments }
    code = re.sub(r"//[^\n]*", " ", code)
    return re.sub(r"'(?:[^'\n]|'')*'", "''", code)  # strings, so that words inside them do not count


def test_pascal_code_is_balanced_and_uses_the_right_event_signatures(sections: dict[str, list[str]]) -> None:
    no_comments = re.sub(r"\{[^}]*\}", " ", "\n".join(sections["Code"]))
    for line in no_comments.splitlines():
        assert line.split("//")[0].count("'") % 2 == 0, f"unclosed string: {line}"
    code = _code(sections)
    assert code.count("(") == code.count(")")
    words = re.findall(r"[A-Za-z_]\w*", code.lower())
    opened = sum(words.count(w) for w in ("begin", "try", "case", "record"))
    assert opened == words.count("end")
    for name, params in PASCAL_EVENTS.items():
        found = re.search(rf"procedure\s+{name}\s*\(([^)]*)\)\s*;", code)
        if found:
            assert found.group(1).strip() == params, f"{name} must take ({params})"
    routines = re.findall(r"(?:procedure|function)\s+(\w+)", code)
    assert len(routines) == len(set(routines))


def test_uninstall_keeps_models_unless_the_user_says_yes(sections: dict[str, list[str]]) -> None:
    raw = "\n".join(sections["Code"])
    tasks = {_entry(line)["Name"] for line in sections["Tasks"]}
    for task in re.findall(r"WizardIsTaskSelected\('(\w+)'\)", raw):
        assert task in tasks
    assert "DeleteAllBut(DataDir(), 'models')" in raw  # the default
    # The question defaults to No, and a silent uninstall never deletes models.
    assert "MB_DEFBUTTON2" in raw and "not UninstallSilent()" in raw
    # The data folder is the app's (platformdirs on Windows: %LOCALAPPDATA%\PolyStrata, STRATA_DATA_DIR overrides).
    assert "GetEnv('STRATA_DATA_DIR')" in raw and "'{localappdata}\\PolyStrata'" in raw
