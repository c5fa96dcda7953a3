; PolyStrata for Windows: Inno Setup script (Inno Setup 6.3 or newer). Build it with packaging\windows\build.ps1,
; which builds the PyInstaller bundle first and passes the defines below; by hand:
;   ISCC.exe /DAppVersion=0.1.0 /DFlavour=cuda /DBundleDir=C:\src\polystrata\dist\PolyStrata packaging\windows\polystrata.iss
; Per-user install (no administrator rights) into %LOCALAPPDATA%\Programs\PolyStrata, Start menu entry, optional
; desktop icon and autostart of the app and of the node agent. The uninstaller keeps the downloaded models in
; %LOCALAPPDATA%\PolyStrata\models unless the user asks to delete them.
; The CUDA bundle is 4-5 GB: disk spanning splits the compressed payload into PolyStrata-...-setup-N.bin files of at
; most 2 GB each, which must stay in the folder of the setup .exe.

#ifndef AppVersion
  #error Pass the version: ISCC /DAppVersion=X.Y.Z (build.ps1 reads it from installer\version.py)
#endif
#ifndef Flavour
  #define Flavour "cpu"
#endif
#ifndef BundleDir
  #define BundleDir "..\..\dist\PolyStrata"
#endif
#ifndef OutputDir
  #define OutputDir "..\..\dist"
#endif

#define AppName "PolyStrata"
#define AppExe "strata.exe"
#define NodeExe "strata-node.exe"

[Setup]
; The AppId identifies PolyStrata across versions (upgrades replace, uninstall finds it): never change it.
AppId={{6F1B7C2E-3D4A-4E8B-9A57-2C0E5D9B4F13}
AppName={#AppName}
AppVersion={#AppVersion}
AppVerName={#AppName} {#AppVersion} ({#Flavour})
AppPublisher=PolyStrata
VersionInfoVersion={#AppVersion}
DefaultDirName={autopf}\{#AppName}
DefaultGroupName={#AppName}
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
OutputDir={#OutputDir}
OutputBaseFilename={#AppName}-{#AppVersion}-windows-{#Flavour}-setup
SetupIconFile=..\..\resources\polystrata.ico
UninstallDisplayIcon={app}\{#AppExe}
UninstallDisplayName={#AppName}
WizardStyle=modern
Compression=lzma2/normal
SolidCompression=no
DiskSpanning=yes
DiskSliceSize=2000000000
CloseApplications=yes
RestartApplications=no

[Languages]
Name: "english"; MessagesFile: "compiler:Default.isl"

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked
Name: "autostart"; Description: "Start PolyStrata (tray app and API server) when I sign in"; GroupDescription: "Autostart:"; Flags: unchecked
Name: "autostartnode"; Description: "Start the node agent when I sign in (lets another PC use this PC's GPUs)"; GroupDescription: "Autostart:"; Flags: unchecked

[Files]
Source: "{#BundleDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs
Source: "..\..\resources\polystrata.ico"; DestDir: "{app}"; Flags: ignoreversion

[Icons]
Name: "{autoprograms}\{#AppName}"; Filename: "{app}\{#AppExe}"; IconFilename: "{app}\polystrata.ico"
Name: "{autodesktop}\{#AppName}"; Filename: "{app}\{#AppExe}"; IconFilename: "{app}\polystrata.ico"; Tasks: desktopicon
Name: "{userstartup}\{#AppName}"; Filename: "{app}\{#AppExe}"; IconFilename: "{app}\polystrata.ico"; Tasks: autostart
Name: "{userstartup}\{#AppName} node agent"; Filename: "{app}\{#NodeExe}"; Parameters: "serve"; IconFilename: "{app}\polystrata.ico"; Flags: runminimized; Tasks: autostartnode

[Run]
Filename: "{app}\{#AppExe}"; Description: "{cm:LaunchProgram,{#AppName}}"; Flags: nowait postinstall skipifsilent

[UninstallDelete]
; Files the app writes beside itself at run time (none expected; a crash dump at most).
Type: filesandordirs; Name: "{app}"

[Code]
{ The app keeps settings, chat history, usage profiles and models in one folder (platformdirs: %LOCALAPPDATA%\PolyStrata,
  or STRATA_DATA_DIR / STRATA_CONFIG_DIR where set). Uninstalling removes all of it except models\, which goes only
  when the user says so. }

function DataDir(): String;
begin
  Result := GetEnv('STRATA_DATA_DIR');
  if Result = '' then
    Result := ExpandConstant('{localappdata}\PolyStrata');
end;

function ConfigDir(): String;
begin
  Result := GetEnv('STRATA_CONFIG_DIR');
  if Result = '' then
    Result := ExpandConstant('{localappdata}\PolyStrata');
end;

{ Delete everything in Dir except the entry named Keep (none when Keep is empty); Dir itself goes when empty. }
procedure DeleteAllBut(Dir: String; Keep: String);
var
  Rec: TFindRec;
  Path: String;
begin
  if not DirExists(Dir) then
    exit;
  if FindFirst(AddBackslash(Dir) + '*', Rec) then
  begin
    try
      repeat
        if (Rec.Name <> '.') and (Rec.Name <> '..') and (CompareText(Rec.Name, Keep) <> 0) then
        begin
          Path := AddBackslash(Dir) + Rec.Name;
          if Rec.Attributes and FILE_ATTRIBUTE_DIRECTORY <> 0 then
            DelTree(Path, True, True, True)
          else
            DeleteFile(Path);
        end;
      until not FindNext(Rec);
    finally
      FindClose(Rec);
    end;
  end;
  RemoveDir(Dir);
end;

procedure CurStepChanged(CurStep: TSetupStep);
var
  ResultCode: Integer;
begin
  { The node agent can only start at sign-in where this build's agent has a serve command. }
  if (CurStep = ssPostInstall) and WizardIsTaskSelected('autostartnode') then
  begin
    if not Exec(ExpandConstant('{app}\{#NodeExe}'), 'serve --help', '', SW_HIDE, ewWaitUntilTerminated, ResultCode)
      or (ResultCode <> 0) then
    begin
      DeleteFile(ExpandConstant('{userstartup}\{#AppName} node agent.lnk'));
      SuppressibleMsgBox('The node agent in this version (strata-node) has no serve command yet, so it cannot start '
        + 'when you sign in; nothing was set up for it.', mbInformation, MB_OK, IDOK);
    end;
  end;
end;

procedure CurUninstallStepChanged(CurUninstallStep: TUninstallStep);
var
  RemoveModels: Boolean;
  Models: String;
begin
  if CurUninstallStep <> usPostUninstall then
    exit;
  Models := AddBackslash(DataDir()) + 'models';
  RemoveModels := False;
  if DirExists(Models) and not UninstallSilent() then
    RemoveModels := MsgBox('Also delete the downloaded models in ' + Models + '?' + #13#10#13#10
      + 'Choose No to keep them for a later installation.', mbConfirmation, MB_YESNO or MB_DEFBUTTON2) = IDYES;
  if ConfigDir() <> DataDir() then
    DelTree(ConfigDir(), True, True, True);
  if RemoveModels then
    DeleteAllBut(DataDir(), '')
  else
    DeleteAllBut(DataDir(), 'models');
end;
