@echo off
rem PolyStrata for Windows: set up on the first run, then start the app.
rem   START-HERE.bat             open the app
rem   START-HERE.bat --headless  serve the OpenAI-compatible API without a window
setlocal
cd /d "%~dp0"
set "VENV=%CD%\.venv"
if not exist "%VENV%\Scripts\python.exe" (
  where py >nul 2>nul && (py -3 -m venv "%VENV%") || (python -m venv "%VENV%")
  if errorlevel 1 (
    echo [polystrata] Python 3.11 or newer is needed: install it from python.org ^(tick "Add to PATH"^) and run this again.
    pause
    exit /b 1
  )
  "%VENV%\Scripts\python.exe" -m pip install -q --upgrade pip
)
set "PY=%VENV%\Scripts\python.exe"
"%PY%" -c "import torch" >nul 2>nul
if errorlevel 1 (
  nvidia-smi -L >nul 2>nul
  if errorlevel 1 (
    echo [polystrata] no NVIDIA driver found: installing the CPU build of PyTorch
    "%PY%" -m pip install "torch>=2.4" --index-url https://download.pytorch.org/whl/cpu
  ) else (
    echo [polystrata] NVIDIA driver found: installing PyTorch with CUDA ^(about 3 GB^)
    "%PY%" -m pip install "torch>=2.4" --index-url https://download.pytorch.org/whl/cu128
  )
)
"%PY%" -m pip install -q -e .
if errorlevel 1 ( echo [polystrata] installing PolyStrata failed, see above & pause & exit /b 1 )
if /i "%~1"=="--headless" (
  "%VENV%\Scripts\strata.exe" %*
) else (
  start "" "%VENV%\Scripts\pythonw.exe" -m app.main %*
)
