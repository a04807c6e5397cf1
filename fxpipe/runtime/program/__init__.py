"""The runtime plan and the written program: ProgramSpec and program.json (its fields and their
check), the program's folder, its imports, arguments, data, weights and launcher."""
