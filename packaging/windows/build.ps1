# PolyStrata for Windows: build the PyInstaller bundle and the Inno Setup installer.
#   powershell -ExecutionPolicy Bypass -File packaging\windows\build.ps1 -Flavour cuda
#   powershell -ExecutionPolicy Bypass -File packaging\windows\build.ps1 -Flavour cpu
# Needs: Python 3.11+ (python.org, "py" launcher) and Inno Setup 6.3+ (ISCC.exe on PATH or in its default folder).
# Writes dist\PolyStrata\ (the bundle) and dist\PolyStrata-<version>-windows-<flavour>-setup.exe (+ -N.bin slices).
param(
    [ValidateSet("cpu", "cuda")] [string] $Flavour = "cuda",
    [string] $Venv = ".venv-build",
    [string] $TorchIndex = ""
)
$ErrorActionPreference = "Stop"
$Root = Resolve-Path (Join-Path $PSScriptRoot "..\..")
Set-Location $Root

function Step($text) { Write-Host "[build] $text" }
function Check($what) { if ($LASTEXITCODE -ne 0) { throw "$what failed (exit code $LASTEXITCODE): see above" } }

if (-not (Test-Path "$Venv\Scripts\python.exe")) {
    Step "creating the build environment $Venv"
    & py -3 -m venv $Venv; Check "creating the virtual environment"
    & "$Venv\Scripts\python.exe" -m pip install -q --upgrade pip; Check "upgrading pip"
}
$Py = "$Venv\Scripts\python.exe"
if ($TorchIndex -eq "") {
    $TorchIndex = if ($Flavour -eq "cuda") { "https://download.pytorch.org/whl/cu128" } else { "https://download.pytorch.org/whl/cpu" }
}
Step "installing PyTorch ($Flavour) from $TorchIndex"
& $Py -m pip install -q "torch>=2.4" --index-url $TorchIndex; Check "installing PyTorch"
Step "installing PolyStrata with the build extra"
& $Py -m pip install -q -e ".[build]"; Check "installing PolyStrata"

Step "building the bundle (dist\PolyStrata)"
& $Py -m PyInstaller --noconfirm build.spec; Check "PyInstaller"
$Version = (& $Py -c "from installer.version import __version__; print(__version__)").Trim()
$HasCuda = Test-Path "dist\PolyStrata\_internal\torch\lib\torch_cuda.dll"
if (($Flavour -eq "cuda") -ne $HasCuda) { throw "the bundle's torch does not match -Flavour $Flavour (torch_cuda.dll present: $HasCuda)" }
Step ("bundle: {0:N0} MB" -f ((Get-ChildItem dist\PolyStrata -Recurse -File | Measure-Object Length -Sum).Sum / 1MB))

$Iscc = (Get-Command ISCC.exe -ErrorAction SilentlyContinue).Source
if (-not $Iscc) {
    foreach ($dir in @("${env:ProgramFiles(x86)}\Inno Setup 6", "$env:ProgramFiles\Inno Setup 6", "$env:LOCALAPPDATA\Programs\Inno Setup 6")) {
        if (Test-Path "$dir\ISCC.exe") { $Iscc = "$dir\ISCC.exe"; break }
    }
}
if (-not $Iscc) { throw "ISCC.exe (Inno Setup 6.3 or newer) was not found: install it from jrsoftware.org or put ISCC.exe on PATH" }
Step "compiling the installer with $Iscc"
& $Iscc "/DAppVersion=$Version" "/DFlavour=$Flavour" "/DBundleDir=$Root\dist\PolyStrata" "/DOutputDir=$Root\dist" "packaging\windows\polystrata.iss"
Check "ISCC"
Get-ChildItem "dist\PolyStrata-$Version-windows-$Flavour-setup*" | ForEach-Object { Step ("{0} ({1:N0} MB)" -f $_.Name, ($_.Length / 1MB)) }
